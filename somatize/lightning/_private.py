"""Every private Lightning name somatize relies on, in one place: a Lightning upgrade that
drops one breaks here, with an error naming the attribute and the installed version.
``tests/test_private.py`` pins each name on the installed Lightning.

    asked = devices_asked(trainer)          # what Trainer(devices=...) was given
    set_launcher(strategy, launcher)        # in Strategy._configure_launcher
"""

from __future__ import annotations

from typing import Any

import lightning
from lightning.pytorch.strategies.launchers import launcher as _launcher_module

from .._errors import SomatizeError

# (owner, attribute) pairs read or written below, for the pinning test
NAMES = [("Trainer._accelerator_connector", "_devices_flag"),
         ("Trainer._accelerator_connector", "_parallel_devices"),
         ("lightning.pytorch.strategies.launchers.launcher", "_Launcher"),
         ("Strategy", "_launcher"), ("Strategy", "_root_device"),
         ("Strategy", "_lightning_optimizers"), ("Strategy", "_configure_launcher")]


def _gone(owner: str, name: str) -> SomatizeError:
    return SomatizeError(
        f"Lightning {lightning.__version__} has no {owner}.{name}, which SomatizeStrategy "
        "reads (somatize/lightning/_private.py): install the Lightning version somatize "
        "supports (see pyproject.toml), or report the version")


def _read(obj: Any, owner: str, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _gone(owner, name) from None


def _connector(trainer: Any) -> Any:
    return _read(trainer, "Trainer", "_accelerator_connector")


def devices_asked(trainer: Any) -> Any:
    """What ``Trainer(devices=...)`` was given: a single-device strategy makes Lightning
    report one device, whatever was asked."""
    return _read(_connector(trainer), "Trainer._accelerator_connector", "_devices_flag")


def parallel_devices(trainer: Any) -> list:
    """The devices Lightning's accelerator chose (``accelerator="gpu"`` gives cuda:N)."""
    return _read(_connector(trainer), "Trainer._accelerator_connector", "_parallel_devices")


def launcher_base() -> type:
    """Lightning's launcher base class (``_Launcher``)."""
    return _read(_launcher_module, "lightning.pytorch.strategies.launchers.launcher",
                 "_Launcher")


def set_launcher(strategy: Any, launcher: Any) -> None:
    """Install ``launcher`` (what ``Strategy._configure_launcher`` does)."""
    _read(strategy, "Strategy", "_launcher")
    strategy._launcher = launcher


def set_root_device(strategy: Any, device: Any) -> None:
    """Set a single-device strategy's device before Lightning sets its environment up."""
    _read(strategy, "Strategy", "_root_device")
    strategy._root_device = device


def lightning_optimizers(strategy: Any) -> list:
    """The ``LightningOptimizer`` wrappers Lightning hands the user's code."""
    return list(_read(strategy, "Strategy", "_lightning_optimizers"))
