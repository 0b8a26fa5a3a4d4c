"""The names of the head's statistics (``PartialFC.stats``): one spelling for the head, the
trainer's log records and the figures drawn from them.

``SCALE`` the logit scale ``s``; ``THETA_MED`` the median target angle (rad); ``B_AVG``
AdaCos' ``B_avg`` (arXiv:1905.00292 Eq. 9); ``LOSS`` the global batch's loss;
``COS_TARGET_MEAN`` / ``COS_NONTARGET_MEAN`` the mean target / sampled non-target cosine;
``SUBCENTER_SHARE`` the share of samples nearest their class's dominant centre (sub-center
heads only, ``partial_fc.subcenters.DominantShare``).
"""

SCALE = "scale"
THETA_MED = "theta_med"
B_AVG = "b_avg"
LOSS = "loss"
COS_TARGET_MEAN = "cos_target_mean"
COS_NONTARGET_MEAN = "cos_nontarget_mean"
SUBCENTER_SHARE = "subcenter_dominant_share"

# The statistics that follow the scale's dynamics, in the order a log record lists them.
SCALE_DYNAMICS = (SCALE, THETA_MED, B_AVG, COS_TARGET_MEAN, COS_NONTARGET_MEAN)
# Every key of ``PartialFC.stats``.
HEAD_STATS = (*SCALE_DYNAMICS, LOSS)
# Statistics only some heads have (a log record lists those present).
OPTIONAL_STATS = (SUBCENTER_SHARE,)
