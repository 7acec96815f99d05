"""Small display filters for the pages."""
from django import template

register = template.Library()

DASH = "\u2014"


@register.filter
def num(value, digits=2):
    """A figure with `digits` decimals, or a dash when there is none."""
    if value is None or value == "":
        return DASH
    try:
        return f"{float(value):.{int(digits)}f}"
    except (TypeError, ValueError):
        return DASH


@register.filter
def pct(value, digits=1):
    if value is None:
        return DASH
    return f"{float(value) * 100:.{int(digits)}f}%"


@register.filter
def ms(value, digits=1):
    if value is None:
        return DASH
    return f"{float(value) * 1000:.{int(digits)}f}"


@register.filter
def duration(seconds):
    """Seconds as '1h 02m', '3m 20s' or '12s'."""
    if seconds is None:
        return DASH
    s = int(round(float(seconds)))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


@register.filter
def short(value, n=12):
    return (value or "")[: int(n)]


@register.filter
def get(mapping, key):
    return mapping.get(key) if hasattr(mapping, "get") else None


@register.filter
def percent_width(value):
    """0..1 as a CSS width."""
    try:
        return f"{max(0.0, min(1.0, float(value))) * 100:.1f}%"
    except (TypeError, ValueError):
        return "0%"


@register.filter
def pm(row, prefix="speedup"):
    """" ± h" after a figure: h is the larger half-width of its 95% interval (the interval
    need not be symmetric; the larger side is shown); empty without an interval. The prefix
    "speedup_prompts" is the speedup's interval across prompts, about the speedup."""
    point = prefix.removesuffix("_prompts")
    if not isinstance(row, dict):
        row = {f: getattr(row, f, None) for f in (point, f"{prefix}_low", f"{prefix}_high")}
    v, lo, hi = row.get(point), row.get(f"{prefix}_low"), row.get(f"{prefix}_high")
    if v is None or lo is None or hi is None:
        return ""
    digits = 1 if prefix == "output_throughput" else 2
    return f" \u00b1 {max(v - lo, hi - v):.{digits}f}"


@register.filter
def interval(row, prefix="speedup"):
    """"[lo, hi]" of a figure's 95% interval, or empty."""
    lo, hi = row.get(f"{prefix}_low"), row.get(f"{prefix}_high")
    if lo is None or hi is None:
        return ""
    return f"[{lo:.2f}, {hi:.2f}]"


@register.filter
def web_url(value):
    """A user-given address as a link target: only http(s) URLs are links (a javascript: or
    data: address is never an href, whatever slipped past the form); else empty."""
    text = str(value or "").strip()
    return text if text.lower().startswith(("http://", "https://")) else ""
