"""A run's instance pools (`instance_pools`), the tokenizer's corpus of them (`tokenizer_corpus`) and the three
harness conventions by name (`swe_harnesses`)."""

import pytest

from orchard.domains.swe.corpus import tokenizer_corpus
from orchard.domains.swe.harness import SWEEvalHarness
from orchard.domains.swe.harnesses import HARNESSES, TRAINABLE, swe_harnesses
from orchard.domains.swe.pools import instance_pools
from orchard.domains.swe.tool_rollout import SWEBashRollouts, SWEToolRollouts


def test_toy_pools_draw_rl_from_train_and_hold_out_other_bugs():
    train, rl, heldout = instance_pools(train_per_template=1, heldout_per_template=1, levels=[1],
                                        templates=["inventory", "ledger"])
    assert rl is train and len(train) == len(heldout) == 2
    assert {i.repo for i in train} == {i.repo for i in heldout} == {"toy/inventory", "toy/ledger"}
    assert not {i.patch for i in train} & {i.patch for i in heldout}  # a held-out bug never seen in training


@pytest.mark.parametrize(("kw", "message"), [
    ({"path": "x.jsonl"}, "heldout_path must be given exactly when path is"),
    ({"heldout_path": "x.jsonl"}, "heldout_path must be given exactly when path is"),
    ({"rl_path": "rl.jsonl"}, "rl_path needs path"),
    ({"repo_root": "repos"}, "repo_root needs path"),
])
def test_pool_mistakes_name_the_argument(kw, message):
    with pytest.raises(ValueError, match=message):
        instance_pools(**kw)


def test_real_pools_and_their_corpus(build_real_swe, fixture_git, tmp_path):
    real = build_real_swe(tmp_path / "real")
    train, rl, heldout = instance_pools(real.path, real.path, repo_root=real.repo_root)
    assert [i.instance_id for i in (*train, *rl, *heldout)] == ["tkem__cachetools-130"] * 3 and rl is train
    # a real instance has no files: the corpus reads the code its fix and its tests touch, and the fix; an instance
    # in several pools counts once
    texts = tokenizer_corpus([*train, *rl, *heldout])
    assert texts == tokenizer_corpus(train) and texts[0] == train[0].problem_statement and train[0].patch in texts
    assert (real.repo / "cachetools/keys.py").read_text() in texts
    assert (real.repo / "tests/test_keys.py").read_text() in texts
    # a snapshot off its base commit: the error starts with the argument that named the file (path is read first)
    fixture_git(real.repo, "commit", "-q", "--allow-empty", "-m", "later work")
    with pytest.raises(ValueError, match=r"^path: tkem__cachetools-130: the snapshot .* is at commit"):
        instance_pools(real.path, real.path, rl_path=real.path, repo_root=real.repo_root)


def test_a_toy_corpus_holds_the_issue_and_every_file():
    [instance] = instance_pools(train_per_template=1, levels=[1], templates=["ledger"])[0]
    assert tokenizer_corpus([instance]) == [instance.problem_statement, *instance.files.values()]
    with pytest.raises(ValueError, match="instances must hold SWEInstance objects, got str"):
        tokenizer_corpus(["an issue"])


def test_swe_harnesses_by_name_share_one_budget():
    harnesses = swe_harnesses(object(), None, max_steps=7, max_tokens=64, max_time_s=30.0, concurrency=3, seed=1)
    assert tuple(harnesses) == HARNESSES and set(TRAINABLE) < set(HARNESSES)
    assert type(harnesses["bash"]) is SWEBashRollouts and harnesses["bash"].convention == "bash"
    assert type(harnesses["tool"]) is SWEToolRollouts and harnesses["tool"].convention == "tool"
    # the held-out convention plays in process, with the same turn budget
    assert isinstance(harnesses["eval"].harness, SWEEvalHarness) and harnesses["eval"].harness.max_steps == 7
