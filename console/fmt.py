"""Numbers with units, the same way on every page."""

from __future__ import annotations

from datetime import UTC, datetime

GIB = 1 << 30


def gib(n: float | None, digits: int = 1) -> str:
    return "n/a" if n is None else f"{n / GIB:.{digits}f} GiB"


def size(n: float | None) -> str:
    """Bytes in GiB, or MiB below a tenth of a GiB, KiB below a MiB."""
    if n is None:
        return "n/a"
    if abs(n) >= 0.1 * GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB" if abs(n) >= 1024 else f"{n:.0f} B"


def used_of(used: float | None, total: float | None) -> str:
    """'2.7 / 24 GiB'."""
    if used is None or not total:
        return "n/a"
    return f"{used / GIB:.1f} / {total / GIB:.0f} GiB"


def count(n: float | None) -> str:
    """Compact counts: 950, 12.3k, 1.2M."""
    if n is None:
        return "n/a"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def times(n: float | None) -> str:
    """A multiple, compact: 0.6x, 256.0x, 12.3kx."""
    if n is None:
        return "n/a"
    return f"{n:.1f}x" if abs(n) < 1000 else f"{count(n)}x"


def watts(n: float | None) -> str:
    return "n/a" if n is None else f"{n:.0f} W"


def celsius(n: float | None) -> str:
    return "n/a" if n is None else f"{n:.0f} °C"


def pct(n: float | None, digits: int = 0) -> str:
    return "n/a" if n is None else f"{n:.{digits}f} %"


def mhz(n: float | None) -> str:
    return "n/a" if n is None else f"{n:.0f} MHz"


def rate(n: float | None, unit: str = "tokens/s") -> str:
    return "n/a" if n is None else f"{n:,.1f} {unit}"


def figure(n: float | None) -> str:
    """A rate as a metric's value, its unit in the label: short enough for a column of a 1280 px wide page
    ("12.3", "1,234", "12.3k")."""
    if n is None:
        return "n/a"
    if n >= 100_000:
        return f"{n / 1000:,.0f}k"
    return f"{n:,.0f}" if n >= 1000 else f"{n:.1f}"


def seconds(n: float | None) -> str:
    if n is None:
        return "n/a"
    if n < 1:
        return f"{n * 1000:.0f} ms"
    if n < 120:
        return f"{n:.1f} s"
    if n < 7200:
        return f"{n / 60:.0f} min"
    return f"{n / 3600:.1f} h"


def since(ts: datetime | float | None) -> str:
    """How long ago, e.g. '3 min ago'."""
    if ts is None:
        return "n/a"
    when = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, UTC)
    return seconds((datetime.now(UTC) - when).total_seconds()) + " ago"


def clock(ts: datetime | float | None) -> str:
    if ts is None:
        return "n/a"
    when = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
