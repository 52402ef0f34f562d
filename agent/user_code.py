"""Code a user brings: a model builder, a loss, a metric or a data source, named by an import
path (``"mypkg.nets:build"``) or a file (``"./nets.py:build"``).

Nothing of it travels: a run names the code, and every device imports its own copy (installed
package or file). A run therefore also carries a fingerprint of the model's parameter names and
shapes (`fingerprint`), so a device whose copy builds something else is rejected with its
reason rather than training a model its neighbours cannot average with; and one of a user
strategy's source (`source_fingerprint`), since two versions of a strategy's code give the
same shapes but different rounds.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

FILE_SUFFIX = ".py"
FILE_MODULE_PREFIX = "edgefl_user_"
"""The module name of a user's file begins so (`load_callable`), its file hash after."""
_FILE_IMPORTS = threading.RLock()
"""Held while a user's file is imported (re-entrant: the file may load another one)."""


def is_import_path(spec: str) -> bool:
    """Whether `spec` names user code (``module:attribute`` or ``file.py:attribute``) rather
    than a bundled name such as ``cnn2d``."""
    return ":" in spec


def _split(spec: str, what: str) -> tuple[str, str]:
    source, _, attribute = spec.rpartition(":")
    if not source or not attribute.isidentifier():
        raise ValueError(
            f"{what} {spec!r} must be MODULE:FUNCTION or ./FILE.py:FUNCTION, "
            "e.g. mypkg.nets:build or ./nets.py:build"
        )
    return source, attribute


def _is_file(source: str) -> bool:
    return source.endswith(FILE_SUFFIX) or "/" in source or "\\" in source


def resolved(spec: str, base: Path | None = None) -> str:
    """`spec` with a file path made absolute (relative to `base`, default the current
    directory), so a run file's ``./nets.py`` means the file beside the run file wherever the
    command runs; an import path is returned unchanged."""
    if not is_import_path(spec):
        return spec
    source, _, attribute = spec.rpartition(":")
    if not _is_file(source):
        return spec
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    return f"{path.resolve()}:{attribute}"


def _module_from_file(path: Path, what: str, spec: str) -> Any:
    if not path.is_file():
        raise ValueError(f"{what} {spec!r}: no such file {path}")
    # One module per file path: the same file imported twice is the same module. Agents
    # sharing a process (agent/host.py) import at once: one runs the file while the others
    # wait, rather than taking a module whose code has not run yet.
    name = FILE_MODULE_PREFIX + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    with _FILE_IMPORTS:
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"{what} {spec!r}: {path} is not a Python file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable `spec` names; ValueError with one line when it cannot be imported, is
    missing or is not callable. `what` names it in errors ("model", "loss", "data source")."""
    source, attribute = _split(spec, what)
    try:
        if _is_file(source):
            module = _module_from_file(Path(source).expanduser(), what, spec)
        else:
            module = importlib.import_module(source)
    except ValueError:
        raise
    except ModuleNotFoundError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import {source}: {exc}") from None
    except Exception as exc:  # the user's module failed while importing
        raise ValueError(
            f"{what} {spec!r}: importing {source} failed: {type(exc).__name__}: {exc}"
        ) from None
    found = getattr(module, attribute, None)
    if found is None:
        raise ValueError(f"{what} {spec!r}: {source} has no {attribute}")
    if not callable(found):
        raise ValueError(f"{what} {spec!r}: {attribute} is not callable")
    return found


def build_user_model(spec: str, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """Call the builder `spec` names with ``(input_shape, num_outputs)`` and check it returned
    a module; ValueError with one line naming what went wrong."""
    from torch import nn  # here: naming and resolving user code needs no torch

    builder = load_callable(spec, "model")
    try:
        model = builder(tuple(input_shape), num_outputs)
    except Exception as exc:
        raise ValueError(
            f"model {spec!r}: build({tuple(input_shape)}, {num_outputs}) failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model {spec!r}: the builder must return a torch.nn.Module, got {type(model).__name__}"
        )
    return model


def fingerprint(model: nn.Module) -> str:
    """A short digest of the model's state-dict names, shapes and dtypes: equal on two devices
    exactly when their models can exchange weights entry by entry."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()[:16]


PROJECT_PACKAGES = ("agent", "coordinator", "protocol", "edgefl")
"""The project's own packages: their code is the installed version's, not the user's."""


def source_fingerprint(cls: type) -> str:
    """A short digest of the source files of `cls` and of the other user classes it derives
    from (the project's own, whose version the fleet checks apart, left out): equal on two
    devices exactly when their copies of the user's code are the same text."""
    digest = hashlib.sha256()
    files = dict.fromkeys(
        inspect.getsourcefile(c) or ""
        for c in cls.__mro__
        if c.__module__.partition(".")[0] not in (*PROJECT_PACKAGES, "builtins", "abc")
    )
    for file in files:
        digest.update(Path(file).read_bytes() if file else b"")
    return digest.hexdigest()[:16]
