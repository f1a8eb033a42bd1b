"""One pool-sizing rule (issue #34 item 4): `hicache plan` of a pool is what SGLang 0.5.23's own
constructor allocates - pages (its padding page included) and bytes - and what hicache's pool
built by the same constructor allocates, for --hicache-size figures that land on a page boundary
and off it and for ratio sizing. Judged by SGLang's real pool class (the wheel, on CPU)."""

from __future__ import annotations

import json

import pytest
from sglang_support import published, sglang  # noqa: F401 - sglang: a fixture

from hicache.cli._main import main
from hicache.testing import fake_cuda
from hicache.effects import HostSetup

torch = pytest.importorskip("torch")

PAGE, LAYERS, HEADS, DIM, DEVICE_TOKENS = 16, 3, 2, 64, 256
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2  # K and V, bf16: 1536 bytes
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": LAYERS,
          "num_attention_heads": 4, "num_key_value_heads": HEADS, "hidden_size": 256, "head_dim": DIM,
          "torch_dtype": "bfloat16"}
SIZINGS = [
    (["--host-gb", "0.01"], dict(host_size=0.01)),                                  # 6510.4 tokens: off a page
    (["--host-gb", str(400 * PAGE * PER_TOKEN / 1e9)], dict(host_size=400 * PAGE * PER_TOKEN / 1e9)),  # on one
    (["--ratio", "2", "--device-tokens", str(DEVICE_TOKENS)], dict(host_size=0)),     # 512 tokens: on one
    (["--host-gb", "0.00012288"], dict(host_size=0.00012288)),  # exactly 80 tokens; SGLang's floats make it 79
]


def _planned(tmp_path, capsys, flags) -> dict:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    assert main(["plan", "--config", str(config), "--tp", "1", "--page-size", str(PAGE), "--layout",
                 "page_first_direct", *flags, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags, sizing", SIZINGS, ids=["off-a-page", "on-a-page", "ratio", "sglangs-float-arithmetic"])
def test_the_plan_of_a_pool_is_what_sglangs_constructor_allocates(sglang, tmp_path, capsys, flags, sizing):
    """plan's pages and bytes == SGLang 0.5.23's MHATokenToKVPoolHost's (its real class) == hicache's."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost as Theirs

    from hicache.pools import MHATokenToKVPoolHost as Ours

    plan = _planned(tmp_path, capsys, flags)
    device = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    kw = dict(device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS - 1)
    with host_memory_budget_scope(10**12):
        theirs = Theirs(info, 2.0, sizing["host_size"], PAGE, "page_first_direct", pin_memory=False, **kw)
    with fake_cuda():
        ours = Ours(info, 2.0, sizing["host_size"], PAGE, "page_first_direct", host=HostSetup(host_memory_bytes=10**12), **kw)
        try:
            assert plan["size"]["page_num"] == theirs.page_num == ours.page_num, (plan["size"], theirs.page_num)
            assert plan["size"]["tokens"] == theirs.size == ours.size
            allocated = theirs.kv_buffer.numel() * theirs.kv_buffer.element_size()
            assert allocated == ours.kv_buffer.numel() * ours.kv_buffer.element_size()
            assert plan["totals"]["total_bytes"] == allocated
        finally:
            ours.destroy()


def test_the_older_ceiling_stays_an_option():
    """size_pool(rule="ceil") keeps the older rule (no padding page on a page-aligned count);
    0.5.23's rule adds it - one function, two named forms, nothing else."""
    from hicache.plan import SIZING_RULES, size_pool

    assert set(SIZING_RULES) == {"sglang-0.5.23", "ceil"}
    ceil = size_pool(size_per_token_bytes=PER_TOKEN, page_size=PAGE, device_tokens=256, host_to_device_ratio=2,
                     rule="ceil")
    padded = size_pool(size_per_token_bytes=PER_TOKEN, page_size=PAGE, device_tokens=256, host_to_device_ratio=2,
                       rule="sglang-0.5.23")
    assert (ceil.page_num, padded.page_num) == (32, 33)
    with pytest.raises(Exception, match="rule must be one of"):
        size_pool(size_per_token_bytes=PER_TOKEN, page_size=PAGE, host_gb=1, rule="newest")


def test_a_dsa_indexer_has_the_pages_sglang_gives_it_in_the_plan_and_in_both_pools(sglang, capsys):
    """The DSA page rule, once (hicache.plan.dsa_indexer_pages): SGLang's own indexer beside its
    MLA anchor, hicache's beside hicache's and the capacity plan's indexer all hold the same pages."""
    from hicache.plan import dsa_indexer_pages

    page = 64
    with published():
        theirs, ours, anchor_size = _dsa_indexers(page)
    assert theirs == ours and theirs[0] == dsa_indexer_pages(anchor_size, page), (theirs, ours)
    assert main(["plan", "--model", "deepseek-v3.2", "--page-size", str(page), "--host-gb", "1", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    indexer = next(p["plan"]["params"] for p in plan["pools"] if p["name"] == "indexer")
    assert indexer["page_num"] == dsa_indexer_pages(plan["size"]["tokens"], page), indexer


def _dsa_indexers(page: int):
    """``((pages, bytes) of SGLang's indexer, (pages, bytes) of hicache's, the anchor's slots)``,
    each beside its own MLA anchor built from one DSA device pool."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost as TheirIndexer
    from sglang.srt.mem_cache.pool_host.dsa import make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost as TheirAnchor

    from hicache.pools import DSAIndexerPoolHost as OurIndexer
    from hicache.pools import MLATokenToKVPoolHost as OurAnchor

    def measured(indexer):
        buffer = indexer.index_k_with_scale_buffer
        return indexer.indexer_page_num, buffer.numel() * buffer.element_size()

    device = DSATokenToKVPool(size=256, page_size=page, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=16,
                              layer_num=2, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=80)
    info = device.get_device_pool_infos()[0].buffer_info
    kw = dict(device_capacity_tokens=256, start_layer=0, end_layer=2, target_layer_num=2)
    with host_memory_budget_scope(10**12):
        their_anchor = TheirAnchor(info, 2.0, 0, page, "page_first", False, "cpu", **kw)
        theirs = measured(TheirIndexer(make_dsa_indexer_pool_decl(device), their_anchor, pin_memory=False))
    with fake_cuda():
        our_anchor = OurAnchor(info, 2.0, 0, page, "page_first", True, "cpu", host=HostSetup(host_memory_bytes=10**12), **kw)
        indexer = OurIndexer(make_dsa_indexer_pool_decl(device), our_anchor, host=HostSetup(host_memory_bytes=10**12))
        try:
            ours = measured(indexer)
        finally:
            indexer.destroy()
            our_anchor.destroy()
    return theirs, ours, their_anchor.size
