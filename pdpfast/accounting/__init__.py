"""Privacy accounting for individualized DP: RDP of the subsampled Gaussian, calibration of
per-record sampling rates and clip norms, rPDP-FL, PDP-SGD, and the per-record ledger."""
from . import pdp, rpdp
from .calibration import calibrate, register_method
from .ledger import IndividualAccountant, PLDIndividualAccountant, ledger_for_plan, register_ledger
from .plan import GroupSummary, PrivacyPlan
from .rdp import DEFAULT_ORDERS, compute_rdp, get_noise_multiplier, get_privacy_spent, get_sample_rate

__all__ = ["DEFAULT_ORDERS", "GroupSummary", "IndividualAccountant", "PLDIndividualAccountant", "PrivacyPlan",
           "calibrate", "compute_rdp", "get_noise_multiplier", "get_privacy_spent", "get_sample_rate",
           "ledger_for_plan", "pdp", "register_ledger", "register_method", "rpdp"]
