"""`sebulba-train`: the launcher (`examples/train.py`) of the checkout sebulba runs from.

`agents/` and `examples/` are folders of the source checkout, not installed packages
(installed, they would shadow a user's own `agents` or `examples`). The console script
finds the checkout next to the installed sebulba package (an editable install,
`pip install -e .`, puts it there), puts the checkout first on `sys.path` and runs
`examples.train` as `python -m examples.train` would, with the same flags.
"""

from __future__ import annotations

import os
import runpy
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def checkout_root(package_dir: str | None = None) -> str | None:
    """The source checkout that holds the sebulba package in `package_dir`, or None.

    A checkout has `examples/train.py`, `agents/registry.py` and `pyproject.toml` beside
    `sebulba/`; an installed (non-editable) sebulba in site-packages has none of them.
    """
    root = os.path.dirname(os.path.realpath(package_dir or _PACKAGE_DIR))
    needed = ("examples/train.py", "agents/registry.py", "pyproject.toml")
    if all(os.path.isfile(os.path.join(root, *path.split("/"))) for path in needed):
        return root
    return None


def main() -> None:
    """Runs the checkout's `examples.train` with this process's arguments."""
    root = checkout_root()
    if root is None:
        sys.exit(
            "sebulba-train runs the launcher of a source checkout (examples/train.py, with "
            "agents/), which is not installed as a package, and there is no checkout beside "
            f"the installed sebulba package ({_PACKAGE_DIR}). Clone sebulba, install the "
            "checkout with `pip install -e .` and run `sebulba-train` or "
            "`python -m examples.train` from it.")
    sys.path.insert(0, root)
    # As `python -m examples.train`: run as __main__, with sys.argv[0] the launcher's path,
    # so that absl's --helpshort lists the launcher's flags.
    runpy.run_module("examples.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
