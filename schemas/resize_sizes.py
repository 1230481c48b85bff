"""One line saying which image sizes a resize-bucket run works at: the target area and each control's two
views (VAE, VL). Setting only the target area leaves the controls at the Edit-Plus ~1024² default, which is
easy to miss on a small-scale run, so the resize summary and `pipeline store inspect` both print this."""

from __future__ import annotations

import math
from typing import Any


def _side(area: int) -> str:
    return f"~{round(math.sqrt(area))}² px"


def sizes_in_force(resize: dict[str, Any]) -> str:
    """From a resize section (the config, or the `resize` attrs an images table records)."""
    t, vae, vl = resize["target_area"], resize["control_vae_area"], resize["control_vl_area"]
    vl_view = (f"VL view {_side(vl)} (resize.control_vl_area {vl})" if resize.get("vl_views", True)
               else "no VL view (resize.vl_views: false)")  # a 2.1 table's
    line = (f"sizes: targets {_side(t)} (resize.target_area {t}); each control: VAE view {_side(vae)} "
            f"(resize.control_vae_area {vae}), {vl_view}")
    if vae > t:
        line += "; controls are larger than targets: resize.area sets both"
    return line
