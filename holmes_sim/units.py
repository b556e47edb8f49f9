"""The only home of unit constants and conversions. Internally everything is SI base units:
seconds, bytes, FLOP, bytes/s, FLOP/s."""

GIB = 1024**3
MIB = 1024**2
GB = 1e9
TERA = 1e12


def gbit_per_s_to_bytes_per_s(gbit: float) -> float:
    """Network line rate in Gbit/s (vendor units, 10^9 bit/s) to bytes/s."""
    return gbit * 1e9 / 8


def bytes_per_s_to_gbit_per_s(rate: float) -> float:
    """bytes/s to Gbit/s."""
    return rate * 8 / 1e9


def gbyte_per_s_to_bytes_per_s(gbyte: float) -> float:
    """GB/s (10^9 bytes/s, as NVLink and HBM data sheets quote) to bytes/s."""
    return gbyte * 1e9


def us_to_s(us: float) -> float:
    """Microseconds to seconds."""
    return us * 1e-6


def tflops_to_flop_per_s(tflops: float) -> float:
    """TFLOP/s (10^12 FLOP/s) to FLOP/s."""
    return tflops * TERA


def gib_to_bytes(gib: float) -> float:
    """GiB (2^30 bytes) to bytes."""
    return gib * GIB
