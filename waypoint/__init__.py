"""Waypoint: every import name of this project lives under ``waypoint``.

The subpackages are the repository's top-level folders, each ``waypoint.<name>`` is ``<name>/``:
``checkpointers``, ``cli``, ``converters``, ``families``, ``models``, ``rewards``, ``run``, ``text`` and ``training``
(pyproject.toml's ``package-dir`` maps them). Generic top-level names such as ``models`` are
left to other distributions (``llama-models`` installs one).

From a checkout that is not installed (a recipe run as ``python recipes/full_finetune.py``), the
checkout's root joins this package's search path, so the same names import.
"""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parents[1]
if (_checkout / "pyproject.toml").is_file() and (_checkout / "checkpointers" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)
