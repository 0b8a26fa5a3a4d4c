"""The one contiguous split rule: classes over ranks (``PartialFC``'s ``class_start``,
``num_local``) and an epoch's samples over loader workers (``data_pipeline.epoch_plan``).
Plain integers, no torch: kept apart from the autograd collectives of
``partial_fc.distributed`` so that the data pipeline can use it without them.
"""

__all__ = ["split_evenly"]


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` items are cut into ``parts``
    contiguous near-equal runs; the first ``total % parts`` parts hold one item more."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)
