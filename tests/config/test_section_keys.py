"""One check of daemon.yaml sections' keys (issue 26): every section says an unknown key the
same way, with a did-you-mean from suggest.py, or the valid keys when nothing is close."""

from __future__ import annotations

from pathlib import Path

import pytest

from det_local.errors import ConfigError
from det_local.federate.settings import load as load_federation
from det_local.sched.settings import load_settings
from det_local.suggest import check_section_keys
from det_local.web.supervisor import load_dashboard_settings


def test_a_misspelt_key_names_its_section_file_and_guess() -> None:
    with pytest.raises(ConfigError) as info:
        check_section_keys("scheduler.", {"preemptoin": 1}, {"preemption", "mode"}, "d.yaml")
    assert (
        str(info.value)
        == "unknown field 'scheduler.preemptoin' in d.yaml; did you mean 'preemption'?"
    )


def test_a_key_nothing_is_close_to_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        check_section_keys("slots.", {"zzzz": 1}, {"cpu_slots", "foreign_gpus_busy"}, "d.yaml")
    assert str(info.value) == (
        "unknown field 'slots.zzzz' in d.yaml; valid: cpu_slots, foreign_gpus_busy"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "scheduler: {preemptoin: true}\n",
            "unknown field 'scheduler.preemptoin' in {p}; did you mean 'preemption'?",
        ),
        ("federation: {prot: 1}\n", "unknown field 'federation.prot' in {p}; did you mean 'port'?"),
        (
            "dashboard: {prot: 8080}\n",
            "unknown field 'dashboard.prot' in {p}; did you mean 'port'?",
        ),
    ],
)
def test_each_section_says_it_the_same_way(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "daemon.yaml"
    path.write_text(text)
    section = text.split(":")[0]
    loader = {
        "scheduler": lambda: load_settings(path),
        "federation": lambda: load_federation(path),
        "dashboard": lambda: load_dashboard_settings(path),
    }[section]
    with pytest.raises(ConfigError) as info:
        loader()
    assert str(info.value) == message.format(p=path)
