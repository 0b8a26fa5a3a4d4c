"""Face-verification metrics: 10-fold pair accuracy (LFW protocol) and IJB-B/C 1:1 TAR@FAR."""
