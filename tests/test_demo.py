"""scripts/demo.py end to end at toy sizes: every stage's command runs and hands its output to the next."""

from conftest import load_script

demo = load_script("demo")


def test_demo_runs_every_stage_and_draws_the_curve(tmp_path):
    cfg = demo.Config(out=tmp_path / "demo", sft_steps=4, rl_steps=2, eval_examples=4, eval_rollouts=1)
    result = demo.main(cfg)
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0
    assert (cfg.out / "sft" / "weights" / "step_4" / "config.json").is_file()
    assert (cfg.out / "rl" / "weights" / "step_2" / "config.json").is_file()
    assert sorted(p.name for p in (cfg.out / "eval").iterdir()) == ["after-rl", "after-sft"]
    png = cfg.out / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
