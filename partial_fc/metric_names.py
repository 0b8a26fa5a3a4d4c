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

# The margins' own statistics (partial_fc.margins, partial_fc.aux_losses), present in
# ``PartialFC.stats`` when the margin or loss is in use: feature norms (AdaFace, MagFace) over
# the global batch, AdaFace's EMAs and its z_hat histogram as the share of the batch in eight
# equal bins over [-1, 1], CurricularFace's t and share of hard negatives among the sampled
# non-target pairs, ElasticFace's mean margin of the step, the weighted values of the
# auxiliary losses and of MagFace's regulariser lambda_g * mean g(a).
NORM_MEAN = "norm_mean"
NORM_STD = "norm_std"
NORM_MIN = "norm_min"
NORM_MAX = "norm_max"
ADAFACE_EMA_MEAN = "adaface_ema_mean"
ADAFACE_EMA_STD = "adaface_ema_std"
ADAFACE_ZHAT_BINS = tuple(f"adaface_zhat_bin{k}" for k in range(8))
CURRICULAR_T = "curricular_t"
HARD_NEGATIVE_SHARE = "hard_negative_share"
ELASTIC_MARGIN_MEAN = "elastic_margin_mean"
LOSS_INTRA = "loss_intra"
LOSS_INTER = "loss_inter"
LOSS_TRIPLET = "loss_triplet"
LOSS_MAGFACE_G = "loss_magface_g"
MARGIN_STATS = (NORM_MEAN, NORM_STD, NORM_MIN, NORM_MAX, ADAFACE_EMA_MEAN, ADAFACE_EMA_STD,
                *ADAFACE_ZHAT_BINS, CURRICULAR_T, HARD_NEGATIVE_SHARE, ELASTIC_MARGIN_MEAN,
                LOSS_INTRA, LOSS_INTER, LOSS_TRIPLET, LOSS_MAGFACE_G)

# Distillation (``distill.*``, partial_fc.distill): the distillation loss of the global batch
# (unweighted), and the student-teacher cosine's summary, ``DISTILL_COS_PREFIX`` + ``mean`` or a
# percentile ``p5``, ``p50``, ``p95`` (partial_fc.distill.cosine_summary's names).
DISTILL_LOSS = "distill_loss"
DISTILL_COS_PREFIX = "distill_cos_"
