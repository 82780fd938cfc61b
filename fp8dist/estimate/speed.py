"""The speed model, under the name the estimate's users know it by: `fp8dist.estimate.speed.linear_speedup(m, k, n,
recipe, gpu)`. The model itself is fp8dist/speed.py, at the package root beside facts/, because the module filter
(backends/module_filter.py: `precision.fp8.min_speedup`) and the audit's `speed` row ask it too, and those layers sit
below estimate/ (docs/architecture.md)."""
from fp8dist.speed import *  # noqa: F401,F403 (the public names: linear_speedup, linear_times, the constants)
from fp8dist.speed import Pass, LinearTimes, Producer, Format  # noqa: F401 (named by step.py and the tests)
