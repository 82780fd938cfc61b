"""What the importer tests share: the keys an import refuses (each refusal must carry a fix)."""
from typing import Callable

import pytest

from fp8dist.formats.common import ImportProblem


def refused_keys(run_import: Callable[[], str]) -> set[str]:
    """The keys the import `run_import()` refuses; it must refuse, and every issue must say its fix."""
    with pytest.raises(ImportProblem) as err:
        run_import()
    assert all(issue.fix for issue in err.value.issues), err.value
    return {issue.path for issue in err.value.issues}
