"""Where ``check_hf_round_trip`` lived before the kit became a package; kept so
``from titan_plugins.testing.hf_check import check_hf_round_trip`` goes on working."""

from titan_plugins.testing.conformance.hf import check_hf_round_trip

__all__ = ["check_hf_round_trip"]
