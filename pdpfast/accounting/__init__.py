"""Privacy accounting for individualized DP: RDP of the subsampled Gaussian, calibration of
per-record sampling rates and clip norms, rPDP-FL, PDP-SGD, and the per-record ledger."""
from . import pdp, rpdp
from .calibration import calibrate, register_method
from .ledger import IndividualAccountant
from .plan import GroupSummary, PrivacyPlan
from .rdp import DEFAULT_ORDERS, compute_rdp, get_noise_multiplier, get_privacy_spent, get_sample_rate

__all__ = ["DEFAULT_ORDERS", "GroupSummary", "IndividualAccountant", "PrivacyPlan", "calibrate", "compute_rdp",
           "get_noise_multiplier", "get_privacy_spent", "get_sample_rate", "pdp", "register_method", "rpdp"]
