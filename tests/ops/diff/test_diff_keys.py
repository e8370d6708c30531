"""One leaf, one name across torch-world formats (issue 30, items 2 and 4).

torch.save and safetensors keys split a torch FQN at every dot (`model/0/weight`);
DCP keeps the FQN whole below its state dict's nesting (`model/0.weight`). `ckpt
diff` matches such leaves by their dotted name, with no --rename, and says so. A
tied weight the other side stores once (transformers' safetensors leave
`lm_head.weight` out) is no difference. `diff --values` shows its progress on a
terminal. The checkpoints are written by torch and transformers themselves.
"""
from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "fixtures"
CKPT = [sys.executable, "-m", "ckpt_tool"]


def run(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CKPT, *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def _model_and_adam() -> dict:
    """A model and its Adam state after one step, as torch's get_state_dict gives them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same state dict through torch.save and dcp.save; a plain module state dict too."""
    import warnings

    d = tmp_path_factory.mktemp("saves")
    sd = _model_and_adam()
    torch.save(sd, d / "full.pt")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(d / "dcp"))
        plain = torch.nn.Sequential(torch.nn.Linear(3, 2)).state_dict()  # {"0.weight", "0.bias"}
        torch.save(plain, d / "plain.pt")
        dcp.save(plain, checkpoint_id=str(d / "plain_dcp"))
        changed = _model_and_adam()
        changed["model"]["2.weight"][1, 0] += 0.5
        dcp.save(changed, checkpoint_id=str(d / "changed_dcp"))
    return d


@pytest.mark.slow
def test_the_readers_split_the_fqns_differently(saves):
    # the premise: were the keys alike, there would be nothing to match
    a = {tuple(l["keys"]) for l in json.loads(run("inspect", saves / "full.pt", "--json").stdout)["leaves"]}
    b = {tuple(l["keys"]) for l in json.loads(run("inspect", saves / "dcp", "--json").stdout)["leaves"]}
    assert ("model", "0", "weight") in a and ("model", "0.weight") in b


@pytest.mark.slow
def test_torch_save_and_dcp_of_one_state_dict_diff_the_same(saves):
    r = run("diff", saves / "full.pt", saves / "dcp", "--values")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == ("dotted   matched 16 leaves by dotted name (keys split at other dots: "
                        "model/0/bias in A, model/0.bias in B)"), r.stdout
    assert lines[-1] == "same: 32 leaves and values match", r.stdout
    # the other way round too, and for a plain nn.Module state dict (no nesting at all)
    assert run("diff", saves / "dcp", saves / "full.pt", "--values").returncode == 0
    r = run("diff", saves / "plain.pt", saves / "plain_dcp", "--values", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["same"] and report["compared"] == 2
    assert report["dotted_matches"] == [{"name": "0.bias", "a": "0/bias", "b": "0.bias"},
                                        {"name": "0.weight", "a": "0/weight", "b": "0.weight"}]


def test_a_changed_tensor_is_reported_by_its_dotted_name(saves):
    r = run("diff", saves / "full.pt", saves / "changed_dcp", "--values", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert [(d["path"], d["kind"], d["mismatched"]) for d in report["differences"]] == [("model.2.weight", "values", 1)]
    assert report["differences"][0]["max_abs"] == pytest.approx(0.5, rel=1e-6)
    assert {"name": "model.2.weight", "a": "model/2/weight", "b": "model/2.weight"} in report["dotted_matches"]


@pytest.mark.parametrize("pattern", ["model/0/**", "model/0.*", "model.0.*", "optim/state/0.weight/*"])
def test_filter_matches_either_sides_spelling(saves, pattern):
    # A spells the leaf model/0/weight, B model/0.weight: a glob written for either keeps the pair
    r = run("diff", saves / "full.pt", saves / "dcp", "--values", "--filter", pattern, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["same"] and report["compared"] in (2, 3) and not report["differences"]


@pytest.mark.slow
def test_a_filter_matching_nothing_is_still_an_error(saves):
    r = run("diff", saves / "full.pt", saves / "dcp", "--filter", "model/9/**")
    assert r.returncode == 1 and "matches none" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_bin_and_its_save_pretrained_safetensors_diff_the_same(tmp_path):
    """transformers' .bin keeps the tied lm_head.weight (one storage with the embedding);
    save_pretrained's safetensors stores it once."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "torch_hf_bin_single")
    model.save_pretrained(tmp_path / "st")
    assert "lm_head.weight" not in __import__("safetensors").safe_open(
        str(tmp_path / "st" / "model.safetensors"), "pt").keys()
    r = run("diff", FIXTURES / "torch_hf_bin_single", tmp_path / "st", "--values")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "tied     lm_head/weight: only in A, the same tensor as model/embed_tokens/weight (compared); B stores it once",
        "same: 20 leaves and values match",
    ]
    # the embedding it shares is compared: a change there is a difference
    with torch.no_grad():
        model.model.embed_tokens.weight[3, 3] += 1
    model.save_pretrained(tmp_path / "st2")
    r = run("diff", FIXTURES / "torch_hf_bin_single", tmp_path / "st2", "--values", "--json")
    assert r.returncode == 1
    assert [d["path"] for d in json.loads(r.stdout)["differences"]] == ["model/embed_tokens/weight"]


@pytest.mark.slow
def test_an_untied_leaf_only_on_one_side_is_still_a_difference(saves, tmp_path):
    sd = torch.load(saves / "full.pt")
    sd["model"]["extra"] = sd["model"]["0.weight"].clone()  # its own storage: not the same tensor
    torch.save(sd, tmp_path / "more.pt")
    r = run("diff", tmp_path / "more.pt", saves / "dcp", "--json")
    assert r.returncode == 1
    assert [(d["path"], d["kind"]) for d in json.loads(r.stdout)["differences"]] == [("model/extra", "only_a")]


def _on_a_terminal(args: list[str]) -> str:
    """Run ckpt with stdout and stderr on a pseudo-terminal; everything it wrote there."""
    main, child = pty.openpty()
    proc = subprocess.Popen([*CKPT, *args], stdout=child, stderr=child, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    os.close(child)
    out = b""
    while True:
        ready, _, _ = select.select([main], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        out += data
    proc.wait(timeout=60)
    os.close(main)
    assert proc.returncode == 0, out
    return out.decode("utf-8", "replace")


@pytest.mark.slow
def test_diff_values_shows_progress_on_a_terminal(saves):
    raw = _on_a_terminal(["diff", str(saves / "full.pt"), str(saves / "dcp"), "--values"])
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)  # the terminal's colours and cursor moves
    # the bar: what it does, and the bytes compared of the total (the arrays of A)
    assert re.search(r"comparing\W+\d+ B / \d+ B", shown), shown
    assert "same: 32 leaves and values match" in shown
    # piped, and with --json: the results only
    r = run("diff", saves / "full.pt", saves / "dcp", "--values")
    assert "comparing" not in r.stdout + r.stderr
    r = run("diff", saves / "full.pt", saves / "dcp", "--values", "--json")
    assert json.loads(r.stdout)["same"] and r.stderr == ""
