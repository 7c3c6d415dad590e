"""`toolkv bench --lab --scenario fleet`'s arguments. The scenario itself runs end to end on a real
Ray fleet in tests/serve_ray/test_lab_fleet.py, which shares that package's Ray instance and fleet."""

from __future__ import annotations

from gateway.cli.main import main


def test_replicas_are_for_a_spawned_fleet(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--replicas", "2", "--lab", "--scenario", "fleet"]) == 2
    assert "--replicas N takes --spawn" in capsys.readouterr().err
