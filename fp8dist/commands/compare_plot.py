"""`fp8dist compare --plot`: both loss curves and the relative gap as a PNG (matplotlib, imported only here), and
the check, before the runs, that it can be written."""
from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

from fp8dist.errors import Fp8distError
from fp8dist.runtime.files import share


def check_writable(path: str) -> None:
    target = Path(path)
    if target.is_dir() or not target.parent.is_dir() or not os.access(target.parent, os.W_OK):
        raise Fp8distError(f"--plot {path}: name a .png file in an existing, writable directory")
    if importlib.util.find_spec("matplotlib") is None:
        raise Fp8distError("--plot needs matplotlib, which is not installed\n  fix: pip install matplotlib "
                           "(part of fp8dist[train])")


def plot(result: dict[str, Any], path: str) -> None:
    """Both loss curves and the relative gap, written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(result["losses"]["baseline"]) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.plot(steps, result["losses"]["baseline"], label=f"baseline: {os.path.basename(result.get('baseline', ''))}")
    top.plot(steps, result["losses"]["config"], label=f"config: {os.path.basename(result.get('config', ''))}",
             linestyle="--")
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    gaps = [g if g is not None else float("nan") for g in result["relative_gaps"]]
    bottom.plot(steps, gaps, color="tab:red")
    bottom.axhline(result["tolerance"], color="gray", linestyle=":", label="tolerance")
    bottom.set_ylabel("relative gap")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".plot.", suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        share(tmp)  # mkstemp's 0600: the plot gets the umask's mode, as open() would give it
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
