"""Per-stage invariants, read from the captured real-model run (conftest ``captured_run``):
each stage's captured inputs and outputs, step by step, checked against the stage's rules
and against the previous stage's captured outputs."""
import pytest
import torch

from positronic_brain.capture import load_file, read_manifest
from positronic_brain.scorers import make_scorer
from positronic_brain.state import FLAG_PROTECTED
from tests.tolerance import products, sum_bound


@pytest.fixture(scope="module")
def capture(captured_run):
    run_dir, result, cache = captured_run
    m = read_manifest(run_dir)

    def load(name):
        return load_file(run_dir / name, m["files"][name], model=m["fingerprint"])

    steps = range(1, len(result["steps"]) + 1)
    files = {t: {s: load(f"{t:06d}_{s}.pt") for s in ("s1_generate", "s2_score", "s3_decide",
                                                     "s4_apply")} for t in steps}
    return load("000000_s0_prime.pt"), files, result, cache


def test_s0_prime_wrote_the_prompt_but_the_pending_token(capture, real_model):
    s0, files, result, _ = capture
    s = real_model.spec
    n = len(result["prompt_ids"]) - 1
    assert s0["cache_len"] == n
    assert s0["outputs"]["k"].shape == s0["outputs"]["v"].shape == (s.n_layers, s.n_kv_heads, n,
                                                                     s.head_dim)
    assert s0["outputs"]["patch"]["appended_slots"] == tuple(range(n))
    view1 = files[1]["s1_generate"]["inputs"]["view"]
    assert view1["token_id"].tolist() == result["prompt_ids"][:-1]
    assert view1["pending_token"] == result["prompt_ids"][-1]
    assert view1["position"].tolist() == list(range(n)) and view1["next_position"] == n


def test_s1_generate_outputs(capture, real_model):
    _, files, result, _ = capture
    s = real_model.spec
    for t, f in files.items():
        view, out = f["s1_generate"]["inputs"]["view"], f["s1_generate"]["outputs"]
        n = view["n"]
        assert f["s1_generate"]["cache_len"] == n
        assert out["logits"].shape == (s.vocab,) and torch.isfinite(out["logits"]).all()
        assert out["input_token"] == view["pending_token"] and out["position"] == view["next_position"]
        assert out["token_id"] == result["generated_ids"][t - 1]
        probs = list(out["report"]["top_probs"])
        # a softmax over the vocabulary (its sum rounded), each probability then rounded to 6
        # decimals (sampler.sample)
        most = 1 + sum_bound(torch.float32, s.vocab) + len(probs) * 10 ** -6 / 2
        assert probs == sorted(probs, reverse=True) and sum(probs) <= most
        assert out["k"].shape == out["v"].shape == (s.n_layers, s.n_kv_heads, 1, s.head_dim)
        att = out["attention"]
        assert att.shape == (s.n_layers, s.n_heads, n) and (att >= 0).all()
        # the rest went to the token itself: a softmax over n + 1 keys, and a sum of n
        assert (att.sum(-1) <= 1 + sum_bound(torch.float32, n + 1)).all()


def test_s2_scores_follow_the_brightness_rule(capture):
    _, files, _, cache = capture
    rule = make_scorer(cache)  # brightness, its fields at their defaults
    for f in files.values():
        view, out = f["s1_generate"]["inputs"]["view"], f["s2_score"]["outputs"]["out"]
        n = view["n"]
        assert out["scores"].shape == (n,) and torch.isfinite(out["scores"]).all()
        b = out["columns"]["brightness"]
        assert b.shape == (n,) and (b >= 0).all() and (b <= rule.max_brightness).all()
        # the rule, from the captured inputs alone: the s1 attention and the value norms
        att, norms = f["s1_generate"]["outputs"]["attention"], f["s2_score"]["inputs"]["value_norms"]
        assert norms.shape == (att.shape[0], att.shape[1] // 3, n) and (norms >= 0).all()
        first = round(rule.skip_layers * att.shape[0])  # brightness leaves these layers out
        norms, att = norms[first:], att[first:]
        w = (norms / norms.mean(-1, keepdim=True)).repeat_interleave(3, dim=1)
        share = n * (att * w).mean((0, 1))
        want = (view["brightness"] - rule.decay + rule.gain * share).clamp(0, rule.max_brightness)
        # two means in series (the norms' over n, the weighted attention's over layers and
        # heads, which the scorer takes per layer first), then the 3-term update on each side
        terms = view["brightness"].abs() + rule.decay + rule.gain * share
        tol = rule.gain * products(torch.float32, max(n, att.shape[0] * att.shape[1]), 2,
                                    float(share.max())) \
            + sum_bound(torch.float32, 3, float(terms.max()))
        assert float((b - want).abs().max()) <= tol


def test_s3_decisions_respect_budget_and_protections(capture):
    _, files, _, cache = capture
    for t, f in files.items():
        view, act = f["s1_generate"]["inputs"]["view"], f["s3_decide"]["outputs"]["out"]
        n = view["n"]
        culls = act["cull_slots"]
        merged = [s for r in act["merges"] for s in r["slots"]]
        assert len(set(culls) | set(merged)) == len(culls) + len(merged), "a slot used twice"
        assert all(0 <= s < n for s in list(culls) + merged)
        assert len(culls) + len(act["merges"]) == max(0, n + 1 - cache.budget)
        order = torch.argsort(view["position"]).tolist()
        protected = set(order[:cache.sinks]) | set(order[n - cache.recent:]) | {
            s for s in range(n) if int(view["flags"][s]) & FLAG_PROTECTED}
        assert not protected & (set(culls) | set(merged)), f"step {t}: a protected slot removed"
        for r in act["merges"]:  # adjacent in text order
            a, b = r["slots"]
            assert order.index(b) == order.index(a) + 1 and r["position"] == int(view["position"][a])
        assert act["reindex"] == (view["next_position"] + 1 >= cache.positions.reindex_at)


def test_s4_applies_exactly_the_decided_patch(capture):
    _, files, result, cache = capture
    seen_uids = set()
    for t, f in files.items():
        view = f["s1_generate"]["inputs"]["view"]
        act, patch = f["s3_decide"]["outputs"]["out"], f["s4_apply"]["outputs"]["out"]
        n = view["n"]
        versions = {f[s]["arena_version"] for s in ("s1_generate", "s2_score", "s3_decide")}
        assert len(versions) == 1, f"step {t}: the arena changed before stage 4"
        assert f["s4_apply"]["arena_version"] not in versions
        assert f["s4_apply"]["cache_len"] == n - len(act["cull_slots"]) - len(act["merges"]) + 1
        assert f["s4_apply"]["cache_len"] == result["steps"][t - 1]["cache_len"] <= cache.budget
        culled = {int(view["uid"][s]) for s in act["cull_slots"]}
        assert set(patch["culled_uids"]) >= culled
        new = set(patch["appended_uids"]) | set(patch["merged_uids"])
        assert not new & seen_uids and all(u > int(view["uid"].max()) for u in new)
        seen_uids |= set(view["uid"].tolist()) | new
        if t + 1 in files:  # the next view holds exactly the survivors and the new tokens
            nxt = set(files[t + 1]["s1_generate"]["inputs"]["view"]["uid"].tolist())
            removed = set(patch["culled_uids"]) | {u for r in patch["merges"] for u in r["uids"]}
            assert nxt == (set(view["uid"].tolist()) - removed) | new
        if patch["reindex_to"] is not None:
            assert sorted(patch["reindex_to"].tolist()) == list(range(len(patch["reindex_to"])))
