"""Fault injection end to end on CPU: ``harness`` (run the trainer, inject a fault), ``cases``
(what each case breaks and checks), ``__main__`` (the table)."""
