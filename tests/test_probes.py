"""Probes: the machine and environment become data; bad environment values are errors."""

from __future__ import annotations

import os

import pytest

from hicache.errors import EnvError
from hicache.plan import kernel_pin_cap
from hicache.effects import probe_limits, probe_machine
from hicache.effects._host._environment import ranks_per_host
from hicache.effects._host._probes import free_2mib_blocks, thp_page_bytes
from hicache.plan import DRIVER_CEILING_BYTES, KERNEL_PIN_CAP_BYTES


def fake_root(tmp_path, *, release="6.12.8", cgroup="max"):
    def put(path, text):
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    put("proc/sys/kernel/osrelease", release + "\n")
    put("proc/sys/vm/max_map_count", "65530\n")
    put("proc/self/cgroup", "0::/job\n")
    put("sys/fs/cgroup/job/memory.max", cgroup + "\n")
    put("sys/fs/cgroup/job/memory.current", "1000\n")
    put("sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n")
    put("sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "512\n")
    put("sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "500\n")
    put("sys/devices/system/node/online", "0-1,3\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    "release, capped",
    [("6.10.3", False), ("6.11.0", True), ("6.13.12-generic", True), ("6.14.1", False), ("5.15.0", False)],
)
def test_kernel_cap_by_release(release, capped):
    """Only 6.11-6.13 get the ~2 GB per-pin cap."""
    assert (kernel_pin_cap(release) == KERNEL_PIN_CAP_BYTES) is capped


def test_probe_machine_reads_a_fake_tree(tmp_path):
    """Kernel, THP, hugepages, cgroup and NUMA facts come from /proc and /sys under root."""
    facts = probe_machine(root=fake_root(tmp_path, cgroup="64000000000"), env={})
    assert facts.kernel_release == "6.12.8" and facts.kernel_pin_cap_bytes == KERNEL_PIN_CAP_BYTES
    assert facts.thp_enabled == "always" and facts.max_map_count == 65530
    assert [(p.size_bytes, p.total, p.free) for p in facts.hugepages] == [(2 * 2**20, 512, 500)]
    assert facts.cgroup_limit_bytes == 64_000_000_000 and facts.cgroup_usage_bytes == 1000
    assert facts.numa_nodes == 3 and facts.ranks_per_host == 1
    assert facts.available_bytes > 0


_V1_UNLIMITED = "9223372036854771712"  # what v1 says for no limit (4 KiB pages)


@pytest.mark.parametrize("layout, files, expected", [
    # cgroup v2: the group's own limit; "max" at the group, a limit above it (a slice, a pod)
    ("0::/job", {"sys/fs/cgroup/job/memory.max": "64000000000", "sys/fs/cgroup/job/memory.current": "1000"},
     (64_000_000_000, 1000)),
    ("0::/pod/ctr", {"sys/fs/cgroup/pod/ctr/memory.max": "max", "sys/fs/cgroup/pod/ctr/memory.current": "5",
                     "sys/fs/cgroup/pod/memory.max": "8000", "sys/fs/cgroup/pod/memory.current": "3000"},
     (8000, 3000)),
    # two limits: the one with least room binds (10000 - 9000 < 8000 - 3000)
    ("0::/pod/ctr", {"sys/fs/cgroup/pod/ctr/memory.max": "10000", "sys/fs/cgroup/pod/ctr/memory.current": "9000",
                     "sys/fs/cgroup/pod/memory.max": "8000", "sys/fs/cgroup/pod/memory.current": "3000"},
     (10000, 9000)),
    ("0::/", {}, (None, None)),  # the root group has no memory.max: no limit
    # cgroup v1's memory controller (a hybrid host: the unified tree beside it has no memory files)
    ("4:memory:/slurm/job7\n0::/", {"sys/fs/cgroup/memory/slurm/job7/memory.limit_in_bytes": "32000000000",
                                     "sys/fs/cgroup/memory/slurm/job7/memory.usage_in_bytes": "2000000000",
                                     "sys/fs/cgroup/memory/memory.limit_in_bytes": _V1_UNLIMITED},
     (32_000_000_000, 2_000_000_000)),
    ("4:cpuacct,memory:/a\n0::/", {"sys/fs/cgroup/memory/a/memory.limit_in_bytes": _V1_UNLIMITED,
                                    "sys/fs/cgroup/memory/memory.limit_in_bytes": _V1_UNLIMITED}, (None, None)),
    # inside a container the host's path is not visible: its own group is the mount's root
    ("4:memory:/kubepods/pod1/ctr\n0::/", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "16000000000",
                                          "sys/fs/cgroup/memory/memory.usage_in_bytes": "7"}, (16_000_000_000, 7)),
    ("0::/job", {"sys/fs/cgroup/job/memory.max": "lots"}, (None, None)),  # unreadable: no limit, no crash
    # the usage less the page cache the kernel reclaims first (memory.stat's file LRU, as MemAvailable)
    ("0::/job", {"sys/fs/cgroup/job/memory.max": "10000", "sys/fs/cgroup/job/memory.current": "9000",
                 "sys/fs/cgroup/job/memory.stat": "anon 2000\nshmem 500\ninactive_file 5000\nactive_file 1000"},
     (10000, 3000)),
    ("4:memory:/j\n0::/", {"sys/fs/cgroup/memory/j/memory.limit_in_bytes": "10000",
                           "sys/fs/cgroup/memory/j/memory.usage_in_bytes": "9000",
                           "sys/fs/cgroup/memory/j/memory.stat": "cache 7000\ninactive_file 100\nactive_file 50\n"
                                                                 "total_inactive_file 5500\ntotal_active_file 1000"},
     (10000, 2500)),  # v1: the group's and its children's (total_), as its usage counts them
    # v2's memory.high (reclaim and throttling start there) is a limit as SGLang 0.5.23 reads it
    ("0::/job", {"sys/fs/cgroup/job/memory.max": "10000", "sys/fs/cgroup/job/memory.high": "6000",
                 "sys/fs/cgroup/job/memory.current": "1000"}, (6000, 1000)),
])
def test_the_cgroup_limit_is_the_tightest_of_the_process_group_and_those_above_it(tmp_path, layout, files, expected):
    """The budget's cgroup figures: v2's memory.max/current or v1's memory controller (still
    mounted on hosts booted with it, where available memory is the host's), read at the
    process's group and every group above it - a parent's limit binds - and the group with
    least room reported, its usage less its page cache; v2's memory.high counts as a limit; v1's
    'unlimited' and unreadable values are no limit - SGLang 0.5.23's own rules."""
    root = fake_root(tmp_path)
    for name in ("sys/fs/cgroup/job/memory.max", "sys/fs/cgroup/job/memory.current"):
        (tmp_path / name).unlink()
    (tmp_path / "proc/self/cgroup").write_text(layout + "\n")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    facts = probe_machine(root=root, env={})
    assert (facts.cgroup_limit_bytes, facts.cgroup_usage_bytes) == expected


def test_probe_limits_from_environment(tmp_path):
    """HICACHE_* variables set the chunk limit, kernel cap and hugepage size."""
    root = fake_root(tmp_path)
    limits = probe_limits(env={"HICACHE_REGISTER_CHUNK": "1GiB", "HICACHE_HUGEPAGE_SIZE": "2MiB"}, root=root)
    assert limits.chunk_limit_bytes == 2**30 and limits.hugepage_bytes == 2**21
    assert limits.kernel_cap_bytes == KERNEL_PIN_CAP_BYTES and limits.hard_ceiling_bytes == DRIVER_CEILING_BYTES
    assert probe_limits(env={"HICACHE_KERNEL_PIN_CAP": "none"}, root=root).kernel_cap_bytes is None
    assert probe_limits(env={}, root=root, chunk_limit_bytes=4096).chunk_limit_bytes == 4096


@pytest.mark.parametrize(
    "env, pattern",
    [
        ({"HICACHE_REGISTER_CHUNK": "12XB"}, r"HICACHE_REGISTER_CHUNK='12XB' is invalid: .*unknown unit 'XB'"),
        ({"HICACHE_REGISTER_CHUNK": "-1GiB"}, r"HICACHE_REGISTER_CHUNK='-1GiB' is invalid"),
        ({"HICACHE_REGISTER_CHUNK": "0"}, r"HICACHE_REGISTER_CHUNK='0' is invalid"),
        ({"HICACHE_HUGEPAGE_SIZE": "3MiB"}, r"HICACHE_HUGEPAGE_SIZE=.3MiB. is invalid: must be a power of two"),
        ({"HICACHE_RANKS_PER_HOST": "eight"}, r"HICACHE_RANKS_PER_HOST='eight' must be a positive integer"),
    ],
)
def test_bad_environment_values_name_variable_and_value(tmp_path, env, pattern):
    """A bad value is an EnvError naming the variable and value, never a silent default."""
    with pytest.raises(EnvError, match=pattern):
        probe_limits(env=env, root=fake_root(tmp_path))
        ranks_per_host(env)


def test_ranks_per_host_falls_back_to_local_world_size():
    """HICACHE_RANKS_PER_HOST beats LOCAL_WORLD_SIZE, which beats 1."""
    assert ranks_per_host({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert ranks_per_host({"LOCAL_WORLD_SIZE": "8", "HICACHE_RANKS_PER_HOST": "4"}) == 4
    assert ranks_per_host({}) == 1


def _doctor_context(tmp_path, *, thp="madvise", blocks=100, total=0, ranks=1, env=None, thp_size=2**21):
    """A doctor Context over injected facts: THP ``thp`` of ``thp_size`` pages, ``blocks`` free 2 MiB
    blocks, a plan of ``total`` bytes per rank for ``ranks`` ranks (no plan when ``total`` is 0)."""
    import attrs

    from hicache.cli._doctor import Context
    from hicache.effects import probe_machine

    facts = attrs.evolve(probe_machine(root=fake_root(tmp_path), env={}), thp_enabled=thp, free_2mib_blocks=blocks,
                         thp_page_bytes=thp_size)
    return Context(plan=object() if total else None, facts=facts, resolved=None, env=env or {}, cuda_binding=None,
                   total=total, calls=1, largest=total, ranks=ranks, limits=None, root=str(tmp_path))


@pytest.mark.parametrize("thp, said", [("madvise", "transparent huge pages for each pre-fault piece"),
                                       ("always", "transparent huge pages for each pre-fault piece"),
                                       ("never", "4 KiB pages here (transparent huge pages: never)")])
def test_the_doctor_says_what_the_default_auto_pages_do_here(tmp_path, thp, said):
    """HICACHE_HUGEPAGES unset means `auto`: doctor says THP where free 2 MiB blocks cover a piece,
    else 4 KiB pages - or 4 KiB pages alone where THP is off - never hugetlbfs pages (it once said
    "hugetlbfs pages (auto)" for the default)."""
    from hicache.cli._doctor import _pools

    check = _pools(_doctor_context(tmp_path, thp=thp))
    assert check.status == "pass" and "auto: " + said in check.finding, check.finding
    assert "hugetlbfs" not in check.finding and "HICACHE_HUGEPAGES unset" in check.finding
    assert "hugetlbfs pages (prefer)" in _pools(_doctor_context(tmp_path, env={"HICACHE_HUGEPAGES": "prefer"})).finding


def test_the_doctor_says_auto_keeps_base_pages_where_huge_pages_are_not_2_mib(tmp_path):
    """A 64 KiB-page arm64 host maps 512 MiB transparent huge pages, which auto does not take:
    the pools, thp and buddyinfo checks say so (no count of blocks for THP it will not use);
    a host that does not say its size is read as 2 MiB's."""
    from hicache.cli._doctor import _buddyinfo, _pools, _thp

    arm = _doctor_context(tmp_path, thp_size=512 * 2**20, total=60 * 2**21)
    assert "auto: base pages here (transparent huge pages are 512 MiB here; auto takes only 2 MiB ones)" in \
        _pools(arm).finding
    assert _thp(arm).finding == "transparent huge pages: madvise, 512 MiB pages: auto keeps base pages here"
    assert "cover" not in _buddyinfo(arm).finding
    for size in (2**21, None):
        usual = _doctor_context(tmp_path, thp_size=size, total=60 * 2**21)
        assert "for each pre-fault piece" in _pools(usual).finding and _thp(usual).finding.endswith("madvise")
        assert "cover" in _buddyinfo(usual).finding


def test_the_doctor_warns_when_thp_is_asked_for_where_the_kernel_gives_none(tmp_path):
    """HICACHE_HUGEPAGES=thp where THP is `never`: the pools get 4 KiB pages, and doctor warns
    saying so and how to enable it; where THP is enabled it passes."""
    from hicache.cli._doctor import _pools

    thp = {"HICACHE_HUGEPAGES": "thp"}
    never = _pools(_doctor_context(tmp_path, thp="never", env=thp))
    assert never.status == "warn" and "transparent huge pages are never here: the pools get 4 KiB pages" in never.finding
    assert "transparent_hugepage/enabled" in never.hint
    assert _pools(_doctor_context(tmp_path, thp="madvise", env=thp)).status == "pass"


def test_the_doctor_counts_every_rank_and_says_what_auto_does_with_too_few_free_blocks(tmp_path):
    """/proc/buddyinfo against a plan: a THP pool needs its 2 MiB blocks for every rank on the host
    (a warning when short); under `auto` too few blocks is no fault - the finding says how many
    pieces' worth are covered and that the rest stays on 4 KiB pages."""
    from hicache.cli._doctor import _buddyinfo

    per_rank = 60 * 2**21  # 60 blocks a rank
    thp = {"HICACHE_HUGEPAGES": "thp"}
    assert _buddyinfo(_doctor_context(tmp_path, blocks=100, total=per_rank, ranks=1, env=thp)).status == "pass"
    short = _buddyinfo(_doctor_context(tmp_path, blocks=100, total=per_rank, ranks=2, env=thp))
    assert short.status == "warn" and "needing 120" in short.finding and "2 rank(s)" in short.finding
    fits = _buddyinfo(_doctor_context(tmp_path, blocks=120, total=per_rank, ranks=2))
    assert fits.status == "pass" and "cover the pool's 120" in fits.finding
    partial = _buddyinfo(_doctor_context(tmp_path, blocks=100, total=per_rank, ranks=2))
    assert partial.status == "pass" and "100 of the pool's 120" in partial.finding
    assert "auto keeps the rest on 4 KiB pages" in partial.finding
    off = _buddyinfo(_doctor_context(tmp_path, blocks=100, total=per_rank, ranks=2, thp="never"))
    assert off.status == "pass" and "auto" not in off.finding  # THP off here: blocks do not matter
    assert "auto" not in _buddyinfo(_doctor_context(tmp_path, blocks=1, total=per_rank,
                                                    env={"HICACHE_HUGEPAGES": "off"})).finding


def test_the_doctors_thp_always_hint_says_what_hicaches_pools_do():
    """THP `always` warns (compaction can stall faults) and says what hicache's own pools take:
    THP only where free blocks cover a piece under the default `auto`, none with `off`."""
    import attrs

    from hicache.cli._doctor import _thp

    class Facts:
        thp_enabled, thp_defrag = "always", "madvise"

    check = _thp(attrs.make_class("C", ["facts"])(Facts()))
    assert check.status == "warn" and "HICACHE_HUGEPAGES=auto" in check.hint and "=off" in check.hint
    assert "opt out unless asked" not in check.hint


def test_free_2mib_blocks_and_the_doctor_warning_before_a_thp_run(tmp_path):
    """/proc/buddyinfo: a free block of order k >= 9 holds 2^(k-9) 2 MiB blocks. doctor warns
    before a THP run (HICACHE_HUGEPAGES=thp) whose pool needs more than are free, and says
    nothing against one that fits or against 4 KiB pages."""
    from hicache.cli._doctor import Context, _buddyinfo
    from hicache.effects import probe_machine

    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/buddyinfo").write_text(
        "Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3\n"
        "Node 0, zone   Normal  27217  22865   8947   7192   3319   1983   1366    688    398    191   2066\n"
    )
    assert free_2mib_blocks(root=str(tmp_path)) == (1 + 3 * 2) + (191 + 2066 * 2)
    assert free_2mib_blocks(root=str(tmp_path / "nowhere")) is None
    facts = probe_machine(root=str(tmp_path), env={})
    blocks = facts.free_2mib_blocks

    def check(total, env):
        return _buddyinfo(Context(plan=object(), facts=facts, resolved=None, env=env, cuda_binding=None,
                                  total=total, calls=1, largest=total, ranks=1, limits=None, root=str(tmp_path)))

    thp = {"HICACHE_HUGEPAGES": "thp"}
    short = check((blocks + 1) * 2**21, thp)
    assert short.status == "warn" and f"needing {blocks + 1:,}" in short.finding and "compact" in short.hint
    assert check(blocks * 2**21, thp).status == "pass"
    assert check((blocks + 1) * 2**21, {"HICACHE_HUGEPAGES": "off"}).status == "pass"  # 4 KiB pages need no blocks


def test_the_huge_page_size_and_the_free_blocks_are_read_with_this_hosts_page_size(tmp_path):
    """Read from the host: hpage_pmd_size gives the THP size (None where the kernel has no such
    file or it is not a size), and /proc/buddyinfo's orders count 2 MiB blocks by the base page
    given: order 9 of 4 KiB pages, order 5 of 64 KiB ones."""
    MiB = 2**20
    sysfs = tmp_path / "sys/kernel/mm/transparent_hugepage"
    sysfs.mkdir(parents=True)
    assert thp_page_bytes(root=str(tmp_path)) is None
    for text, expected in (("536870912\n", 512 * MiB), ("2097152", 2 * MiB), ("madvise", None), ("0", None)):
        (sysfs / "hpage_pmd_size").write_text(text)
        assert thp_page_bytes(root=str(tmp_path)) == expected
    (tmp_path / "proc").mkdir()
    orders = [0] * 11
    orders[5], orders[9], orders[10] = 7, 3, 1  # 64 KiB pages: order 5 is 2 MiB, 9 is 32 MiB, 10 is 64 MiB
    (tmp_path / "proc/buddyinfo").write_text("Node 0, zone   Normal " + " ".join(map(str, orders)) + "\n")
    assert free_2mib_blocks(root=str(tmp_path), page_bytes=64 * 1024) == 7 + 3 * 16 + 32
    assert free_2mib_blocks(root=str(tmp_path), page_bytes=4096) == 3 + 2  # order 9 and up, 4 KiB pages


@pytest.mark.parametrize("marks, env, kind", [
    ({}, {}, None),  # a host
    ({".dockerenv": ""}, {}, "docker"),
    ({"run/.containerenv": ""}, {}, "podman"),
    ({}, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "kubernetes"),  # containerd leaves no file; a pod's variables say
    ({"proc/1/cgroup": "4:memory:/kubepods/burstable/pod1/ctr\n"}, {}, "kubernetes"),  # cgroup v1 shows the path
    ({"proc/1/cgroup": "0::/\n"}, {}, None),  # a cgroup v2 namespace hides it
])
def test_the_container_a_process_runs_in_is_read_from_the_marks_runtimes_leave(tmp_path, marks, env, kind):
    """probe_machine's `container`: docker's /.dockerenv, podman's /run/.containerenv, a
    Kubernetes pod's service variables, PID 1's cgroup path - none of them: None."""
    root = fake_root(tmp_path)
    for name, text in marks.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert probe_machine(root=root, env=env).container == kind


def test_the_doctor_says_who_shares_the_budget_and_warns_in_a_container_on_the_default(tmp_path):
    """host_scope: the directory of the budget lock and where it came from; in a container with
    the default directory a warning that other containers' servers budget the host alone, with
    the bind-mount remedy; a chosen HICACHE_RUNTIME_DIR, or no container, passes; one that cannot
    hold the files (a FIFO) is left to the environment rule's FAIL, not named as the budget's home."""
    import attrs

    from hicache.cli._doctor import _host_scope

    context = _doctor_context(tmp_path)

    def scope(container, env, where="/tmp/hicache-1000"):
        facts = attrs.evolve(context.facts, container=container, runtime_dir=where)
        return _host_scope(attrs.evolve(context, facts=facts, env=env))

    alone = scope("docker", {})
    assert alone.status == "warn" and "in a container (docker)" in alone.finding and "/tmp/hicache-1000 (the default)" \
        in alone.finding
    assert "bind-mount one host directory" in alone.hint and "HICACHE_RUNTIME_DIR" in alone.hint
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    chosen = scope("kubernetes", {"HICACHE_RUNTIME_DIR": str(shared)}, str(shared))
    assert chosen.status == "pass" and f"{shared} (HICACHE_RUNTIME_DIR)" in chosen.finding
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # read fine, but no directory: no budget lock can live there, so none is claimed to
    named = scope("kubernetes", {"HICACHE_RUNTIME_DIR": str(fifo)}, str(fifo))
    assert named.status == "pass" and named.finding == "the runtime directory: see HICACHE_RUNTIME_DIR above"
    xdg = tmp_path / "run"
    xdg.mkdir(mode=0o700)
    host = scope(None, {"XDG_RUNTIME_DIR": str(xdg)}, str(xdg / "hicache"))
    assert host.status == "pass" and "($XDG_RUNTIME_DIR)" in host.finding
    assert scope("docker", {"HICACHE_RUNTIME_DIR": "\0"}, None).status == "pass"  # the environment rule names it


@pytest.mark.parametrize("mode, meminfo, room", [
    ("2", "CommitLimit:    1000 kB\nCommitted_AS:    400 kB\n", 600 * 1024),
    ("2", "CommitLimit:    1000 kB\nCommitted_AS:   1400 kB\n", 0),  # over already: none left, never negative
    ("0", "CommitLimit:    1000 kB\nCommitted_AS:    400 kB\n", None),  # heuristic: free memory counts
    ("2", "MemTotal: 5 kB\n", None),  # /proc does not say
])
def test_strict_overcommit_gives_the_room_left_to_commit_and_the_doctor_weighs_the_plan(tmp_path, mode, meminfo, room):
    """vm.overcommit_memory=2: the room is CommitLimit - Committed_AS (probe_machine's
    commit_room_bytes, else None); doctor's memory check says it and fails a plan whose every
    rank's mapping would not fit it - however much memory is free."""
    from hicache.cli._doctor import _memory

    root = fake_root(tmp_path)
    (tmp_path / "proc/sys/vm/overcommit_memory").write_text(mode + "\n")
    (tmp_path / "proc/meminfo").write_text(meminfo)
    facts = probe_machine(root=root, env={})
    assert facts.commit_room_bytes == room
    if room is None:
        return
    import attrs

    context = attrs.evolve(_doctor_context(tmp_path, total=room // 2 + 4096, ranks=2), facts=facts)
    check = _memory(context)
    assert check.status == "fail" and "strict overcommit (vm.overcommit_memory=2)" in check.finding
    assert "vm.overcommit_memory=0" in check.hint
    if room:
        fits = attrs.evolve(context, total=room // 4, ranks=2)
        assert "strict overcommit" in _memory(fits).finding and "its mmap is refused" not in _memory(fits).finding
