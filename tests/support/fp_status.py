"""The x86 SSE/AVX floating-point status flags of the calling thread (MXCSR), read through glibc's fegetenv.

Two sticky flags say whether code computed through subnormal floats, on any x86 CPU: DE (an operand was
subnormal) and UE (a result was tiny and inexact: an underflow to a subnormal or to zero). These are the cases in
which Intel cores take a microcode assist per instruction; AMD Zen cores set the same flags but barely slow
down, so on AMD the flags are the way to see the subnormal path at all. Flushing (FTZ, DAZ) is
`torch.set_flush_denormal`.

Only meaningful where the op runs on the calling thread: call with `torch.set_num_threads(1)`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

DENORMAL = 0x02  # DE: a subnormal operand
UNDERFLOW = 0x10  # UE: a tiny result (rounded to a subnormal or to zero)
_FLAGS = 0x3F  # every exception flag of MXCSR
_MXCSR_OFFSET = 28  # glibc's x86-64 fenv_t: the 28-byte x87 environment, then MXCSR
_FENV_SIZE = 32


def available() -> bool:
    """Whether this machine has MXCSR and glibc's fenv (x86-64 Linux)."""
    return platform.machine() in ("x86_64", "AMD64") and platform.system() == "Linux" and _libm() is not None


def _libm():
    name = ctypes.util.find_library("m")
    return ctypes.CDLL(name) if name else None


def _read(libm) -> ctypes.Array:
    env = ctypes.create_string_buffer(_FENV_SIZE)
    if libm.fegetenv(env) != 0:
        raise OSError("fegetenv failed")
    return env


def _mxcsr(env) -> int:
    return int.from_bytes(env.raw[_MXCSR_OFFSET:_MXCSR_OFFSET + 4], "little")


def flags_raised(fn) -> int:
    """Runs fn() with MXCSR's exception flags cleared and returns the flags it raised (DENORMAL | UNDERFLOW | ...).
    Every other bit of the environment (rounding, FTZ, DAZ, the masks) is left as it was."""
    libm = _libm()
    env = _read(libm)
    word = _mxcsr(env) & ~_FLAGS
    ctypes.memmove(ctypes.addressof(env) + _MXCSR_OFFSET, word.to_bytes(4, "little"), 4)
    if libm.fesetenv(env) != 0:
        raise OSError("fesetenv failed")
    fn()
    return _mxcsr(_read(libm)) & _FLAGS


def describe(flags: int) -> str:
    names = [n for bit, n in ((DENORMAL, "denormal operand"), (UNDERFLOW, "underflow")) if flags & bit]
    return ", ".join(names) or "none"
