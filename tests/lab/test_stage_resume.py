"""An unlearn stage stopped with its session continues from its newest whole checkpoint, and only that one
keeps its optimizer state."""

import json

from palu_lab.miniature import RESUME_STATE, prune_optimizer_state, resumable_checkpoint


def checkpoint(out_dir, step, whole=True):
    folder = out_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in RESUME_STATE:
        (folder / name).write_bytes(b"state")
    if whole:
        (folder / "trainer_state.json").write_text(json.dumps({"epoch": step}))
    return folder


def test_the_newest_whole_checkpoint_resumes_and_older_ones_lose_their_optimizer_state(tmp_path):
    assert resumable_checkpoint(tmp_path) is None
    first, second = checkpoint(tmp_path, 10), checkpoint(tmp_path, 20)
    assert resumable_checkpoint(tmp_path) == second
    prune_optimizer_state(tmp_path, keep_newest=True)
    assert not (first / "optimizer.pt").exists() and (second / "optimizer.pt").is_file()
    half = checkpoint(tmp_path, 30, whole=False)  # being written, or killed while written
    prune_optimizer_state(tmp_path, keep_newest=True)
    assert (second / "optimizer.pt").is_file() and (half / "optimizer.pt").is_file()
    assert resumable_checkpoint(tmp_path) is None  # the newest is half: the run starts again
    prune_optimizer_state(tmp_path, keep_newest=False)
    assert not (second / "optimizer.pt").exists() and (second / "trainer_state.json").is_file()
