"""The tiers under the pool, tensor side: eviction into host memory then disk (LRU, bounded),
loads back into the pool (exact: bit for bit; int8: the dequantized block), checksummed
files (corrupt or truncated: dropped, logged, deleted; another codec's: not served), a full
disk stopping only the disk tier, a restart indexing the files it finds, and an int8 pool's
blocks kept as they are."""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_cache.tiers import KVTier
from pdserve.engine.tiers import disk as disk_module
from pdserve.engine.tiers.codec import BlockShape, TierCodec
from pdserve.engine.tiers.disk import SUFFIX, DiskTier
from pdserve.engine.tiers.host import HostTier
from pdserve.engine.tiers.store import TierStore
from pdserve.kv_codec import dequantize_blocks, quantize_blocks, quantize_rows

# pool: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
POOL_SHAPE = (6, 2, 2, 4, 1, 8)
SHAPE = BlockShape(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8)
ELEMENTS = 2 * 2 * 4 * 1 * 8
BLOCK_BYTES = {
    "exact": ELEMENTS * 4,  # fp32
    "int8": ELEMENTS + 2 * (2 * 1 * 8 + 2 * 4 * 1),  # values + bf16 K and V scales
}
INT8 = TierCodec("int8", SHAPE, torch.float32)


@pytest.fixture(params=["exact", "int8"])
def codec(request: pytest.FixtureRequest) -> TierCodec:
    return TierCodec(request.param, SHAPE, torch.float32)


def _pool() -> torch.Tensor:
    return torch.randn(POOL_SHAPE, generator=torch.Generator().manual_seed(0))


def _store(
    tmp_path: Path, host_blocks: int, disk_blocks: int, codec: TierCodec = INT8
) -> TierStore:
    disk = DiskTier(tmp_path, disk_blocks * _file_bytes(codec), "model-a", codec)
    return TierStore(HostTier(host_blocks * BLOCK_BYTES[codec.name]), disk, codec)


def _file_bytes(codec: TierCodec = INT8) -> int:
    return BLOCK_BYTES[codec.name] + 46 + len("model-a") + len(codec.tag)


def _expected(pool: torch.Tensor, block_id: int, codec: TierCodec = INT8) -> torch.Tensor:
    if codec.name == "exact":
        return pool[block_id]
    return dequantize_blocks(quantize_blocks(pool[block_id : block_id + 1]), pool.dtype)[0]


def test_payload_sizes_are_what_the_codec_says(codec: TierCodec) -> None:
    assert codec.payload_bytes == BLOCK_BYTES[codec.name]
    assert codec.encode(_pool()[0]).numel() == BLOCK_BYTES[codec.name]


def test_evicted_blocks_go_to_host_then_disk_in_lru_order(tmp_path: Path, codec: TierCodec) -> None:
    pool = _pool()
    store = _store(tmp_path, host_blocks=2, disk_blocks=2, codec=codec)
    store.sync(pool, [(0, 100), (1, 101), (2, 102)], [])
    assert [store.holds(h) for h in (100, 101, 102)] == [True, True, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{100:016x}{SUFFIX}"]
    store.sync(pool, [(3, 103), (4, 104)], [])  # host: 103, 104; disk: 100, 101, 102 -> 101, 102
    assert not store.holds(100), "the disk's oldest file went"
    stats = store.stats()
    assert (stats.host_stored_blocks, stats.disk_stored_blocks) == (5, 3)
    assert stats.host_used_bytes == 2 * BLOCK_BYTES[codec.name]
    file_bytes = _file_bytes(codec)
    assert stats.disk_used_bytes == 2 * file_bytes == stats.disk_bytes_in - file_bytes


def test_every_block_that_changed_place_is_reported_with_its_tier(tmp_path: Path) -> None:
    pool = _pool()
    store = _store(tmp_path, host_blocks=1, disk_blocks=1)
    store.sync(pool, [(0, 100), (1, 101)], [])  # host: 101; disk: 100
    assert store.take_moved() == [100, 101, 100], "both evicted, then 100 pushed down to disk"
    assert [store.tier_of(h) for h in (100, 101, 102)] == [KVTier.DISK, KVTier.HOST, None]
    store.sync(pool, [(2, 102)], [])  # host: 102; disk: 101 (100 evicted)
    assert store.take_moved() == [102, 101, 100]
    assert (list(store.block_hashes(KVTier.HOST)), list(store.block_hashes(KVTier.DISK))) == (
        [102],
        [101],
    )
    (tmp_path / f"{101:016x}{SUFFIX}").write_bytes(b"not a block")
    assert not store.holds(101)
    assert store.take_moved() == [101], "a file failing its checks is a drop"
    assert store.take_moved() == []


def test_a_hit_in_either_tier_loads_the_block(tmp_path: Path, codec: TierCodec) -> None:
    pool = _pool()
    original = pool.clone()
    store = _store(tmp_path, host_blocks=1, disk_blocks=4, codec=codec)
    store.sync(pool, [(0, 100), (1, 101)], [])  # 100 on disk, 101 in host memory
    assert store.holds(100) and store.holds(101)
    pool[4:].zero_()
    store.sync(pool, [], [(4, 100), (5, 101)])
    assert torch.equal(pool[4], _expected(original, 0, codec))
    assert torch.equal(pool[5], _expected(original, 1, codec))
    assert torch.allclose(pool[4], original[0], atol=0.05)
    stats = store.stats()
    assert (stats.host_hit_tokens, stats.disk_hit_tokens) == (4, 4)
    assert stats.host_bytes_out == BLOCK_BYTES[codec.name]
    assert stats.disk_bytes_out == _file_bytes(codec)


def test_the_int8_codec_is_close_but_not_exact() -> None:
    block = _pool()[0]
    back = torch.empty_like(block)
    INT8.decode_into(INT8.encode(block), back)
    assert torch.allclose(back, block, atol=0.05) and not torch.equal(back, block)


def test_evicted_blocks_are_read_before_loads_overwrite_them(
    tmp_path: Path, codec: TierCodec
) -> None:
    pool = _pool()
    original = pool.clone()
    store = _store(tmp_path, host_blocks=4, disk_blocks=4, codec=codec)
    store.sync(pool, [(0, 100)], [])
    # Block 1 is evicted (hash 101) and receives the hit on 100 in the same step.
    store.sync(pool, [(1, 101)], [(1, 100)])
    assert torch.equal(pool[1], _expected(original, 0, codec))
    store.sync(pool, [], [(2, 101)])
    assert torch.equal(pool[2], _expected(original, 1, codec))


def test_a_corrupt_file_is_logged_deleted_and_missed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(tmp_path, host_blocks=0, disk_blocks=4)
    store.sync(_pool(), [(0, 100), (1, 101)], [])
    path = tmp_path / f"{100:016x}{SUFFIX}"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert not store.holds(100)
    assert "crc32" in caplog.text and path.name in caplog.text
    assert not path.exists() and store.holds(101)


def test_a_restart_indexes_good_files_and_drops_truncated_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = _pool()
    original = pool.clone()
    _store(tmp_path, host_blocks=0, disk_blocks=4).sync(pool, [(0, 100), (1, 101), (2, 102)], [])
    cut = tmp_path / f"{101:016x}{SUFFIX}"
    cut.write_bytes(cut.read_bytes()[:-10])
    (tmp_path / "leftover.tmp").write_bytes(b"half a write")
    with caplog.at_level(logging.WARNING):
        restarted = _store(tmp_path, host_blocks=0, disk_blocks=4)
    assert "bytes, header says" in caplog.text
    assert not cut.exists() and not (tmp_path / "leftover.tmp").exists()
    assert [restarted.holds(h) for h in (100, 101, 102)] == [True, False, True]
    restarted.sync(pool, [], [(5, 102)])
    assert torch.equal(pool[5], _expected(original, 2))


def test_another_models_or_codecs_files_are_not_served(tmp_path: Path) -> None:
    _store(tmp_path / "a", host_blocks=0, disk_blocks=4).sync(_pool(), [(0, 100)], [])
    assert 100 not in DiskTier(tmp_path / "a", 10**6, "model-b", INT8)
    _store(tmp_path / "b", host_blocks=0, disk_blocks=4).sync(_pool(), [(0, 100)], [])
    assert 100 not in DiskTier(
        tmp_path / "b", 10**6, "model-a", TierCodec("exact", SHAPE, torch.float32)
    )
    exact_bf16 = TierCodec("exact", SHAPE, torch.bfloat16)
    _store(tmp_path / "c", host_blocks=0, disk_blocks=4, codec=exact_bf16).sync(
        _pool().to(torch.bfloat16), [(0, 100)], []
    )
    assert 100 in DiskTier(tmp_path / "c", 10**6, "model-a", exact_bf16)
    assert 100 not in DiskTier(
        tmp_path / "c", 10**6, "model-a", TierCodec("exact", SHAPE, torch.float32)
    )


def test_a_full_disk_stops_only_the_disk_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(disk_module, "write_file", full_disk)
    pool = _pool()
    store = _store(tmp_path, host_blocks=1, disk_blocks=4)
    with caplog.at_level(logging.WARNING):
        store.sync(pool, [(0, 100), (1, 101), (2, 102), (3, 103)], [])
    assert len(caplog.records) == 1 and "stops writing" in caplog.text
    stats = store.stats()
    assert stats.disk_stopped and stats.disk_stored_blocks == 0 and stats.disk_used_bytes == 0
    assert store.holds(103) and not store.holds(100), "host memory still serves"
    store.sync(pool, [], [(4, 103)])
    assert store.stats().host_hit_tokens == 4


def test_an_int8_pools_blocks_come_back_as_they_left(tmp_path: Path) -> None:
    """From host memory and from disk (a new tier indexing the files too), an int8 pool's
    block is kept byte for byte, values and scales; a float pool's files are not served to
    it."""
    pool = quantize_rows(_pool())  # [blocks, L, 2, bs, H, D + scale bytes] int8
    original = pool.clone()
    codec = TierCodec("exact", BlockShape.of_pool(pool), torch.int8)
    assert codec.payload_bytes == pool[0].numel()
    _store(tmp_path / "float", host_blocks=0, disk_blocks=4).sync(_pool(), [(0, 100)], [])

    def int8_store(directory: Path, host_blocks: int) -> TierStore:
        file_bytes = codec.payload_bytes + 46 + len("model-a") + len(codec.tag)
        disk = DiskTier(directory, 4 * file_bytes, "model-a", codec)
        return TierStore(HostTier(host_blocks * codec.payload_bytes), disk, codec)

    store = int8_store(tmp_path / "int8", host_blocks=1)
    store.sync(pool, [(0, 200), (1, 201)], [])  # 200 on disk, 201 in host memory
    assert store.holds(200) and store.holds(201)
    store.sync(pool, [], [(4, 200), (5, 201)])
    assert torch.equal(pool[4], original[0]) and torch.equal(pool[5], original[1])
    restarted = int8_store(tmp_path / "int8", host_blocks=1)
    assert restarted.holds(200)
    restarted.sync(pool, [], [(3, 200)])
    assert torch.equal(pool[3], original[0])
    assert not int8_store(tmp_path / "float", host_blocks=0).holds(100)


def test_a_prefetch_reads_disk_blocks_off_the_engines_thread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup after a prefetch finds the blocks read and checked by the tier's reader
    thread; a corrupt file found that way is dropped as it would be on the spot."""
    pool = _pool()
    original = pool.clone()
    store = _store(tmp_path, host_blocks=0, disk_blocks=4)
    store.sync(pool, [(0, 100), (1, 101)], [])
    path = tmp_path / f"{101:016x}{SUFFIX}"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    readers: list[str] = []
    read = DiskTier.read

    def spied(self: DiskTier, block_hash: int) -> object:
        readers.append(threading.current_thread().name)
        return read(self, block_hash)

    monkeypatch.setattr(DiskTier, "read", spied)
    store.prefetch([100, 101, 102])
    with caplog.at_level(logging.WARNING):
        assert store.holds(100) and not store.holds(101)
    assert "crc32" in caplog.text and not path.exists()
    assert len(readers) == 2 and all(r.startswith("kv-disk-tier") for r in readers), readers
    store.sync(pool, [], [(4, 100)])
    assert torch.equal(pool[4], _expected(original, 0))
