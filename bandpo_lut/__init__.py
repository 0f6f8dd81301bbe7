"""bandpo_lut: BandPO trust-region ratio bounds by table lookup, for PPO-family losses.

    lower, upper = bandpo_lut.bounds(p_old, delta=0.05)           # the band
    clipped = bandpo_lut.clip(ratio, p_old, delta=0.05)           # torch.clamp(ratio, lower, upper)

Importing the package compiles nothing; it loads the compiled extension when there is one (a few tens of
ms), so that a saved program using the ops (torch.export.load, torch.jit.load) finds them after
`import bandpo_lut` alone. A missing or unfit extension is reported, with what to do, on first use.
"""
from bandpo_lut._version import __version__
from bandpo_lut.runtime.band import bounds, clip
from bandpo_lut.runtime.loss import COUNTS, FRACTIONS, BandPolicyLoss, metrics_from_counts, policy_loss
from bandpo_lut.runtime.settings import LossSettings
from bandpo_lut.tables.divergences import names as divergence_names


def _register_ops() -> None:
    try:
        from bandpo_lut.runtime import _ops  # noqa: F401  (registers torch.ops.bandpo_lut, its fake kernels and autograd)
    except ImportError:
        pass   # no usable extension: the first call raises _extension.load()'s ImportError, which says why


_register_ops()


def build_info() -> dict:
    """What the compiled extension was built with (CUDA or CPU, versions, arch list) and the shipped
    tables' provenance."""
    from bandpo_lut.runtime import _extension
    from bandpo_lut.tables import store as tables

    info = dict(_extension.build_info())
    info["tables"] = tables.provenance()
    return info


__all__ = ["bounds", "clip", "policy_loss", "fused_linear_policy_loss", "BandPolicyLoss", "LossSettings",
           "metrics_from_counts",
           "COUNTS", "FRACTIONS", "build_info", "divergence_names", "__version__"]


def __getattr__(name: str):
    # `bandpo_lut.reference.bounds(...)` (the float64 table reader) and `bandpo_lut.reference.policy_loss` (the
    # loss's specification) work after `import bandpo_lut` alone, without importing the references with the package.
    if name == "fused_linear_policy_loss":   # its module is small, but keep `import bandpo_lut` minimal
        from bandpo_lut.runtime.fused_linear import fused_linear_policy_loss

        return fused_linear_policy_loss
    if name == "reference":
        import importlib

        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module 'bandpo_lut' has no attribute {name!r}")
