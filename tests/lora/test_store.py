"""LoraStore and pack handling on their own: zip packs, links, eviction under the disk budget."""

from __future__ import annotations

import asyncio
import stat
import zipfile

import pytest

from engine.errors import LoraUnavailableError
from lora_store.pack import build_pack, unpack
from lora_store.store import LoraStore, StoreLimits
from tests.lora.adapters import write_tar
from tests.lora.pack_server import PackServer


def _zip_pack(adapter_dir, out):
    with zipfile.ZipFile(out, "w") as zf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(adapter_dir / name, f"my-adapter/{name}")
    return out


def test_zip_packs_unpack_into_their_folder(tmp_path, adapters):
    pack = _zip_pack(adapters["mlp"], tmp_path / "a.zip")
    adapter = unpack(pack, tmp_path / "out")
    assert adapter.name == "my-adapter" and (adapter / "adapter_model.safetensors").is_file()


def test_a_symlink_in_a_zip_is_refused(tmp_path):
    pack = tmp_path / "link.zip"
    with zipfile.ZipFile(pack, "w") as zf:
        info = zipfile.ZipInfo("adapter_model.safetensors")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(LoraUnavailableError, match="link") as err:
        unpack(pack, tmp_path / "out")
    assert err.value.code == "invalid_pack"


def test_too_many_files_are_refused(tmp_path):
    pack = tmp_path / "many.zip"
    with zipfile.ZipFile(pack, "w") as zf:
        for i in range(100):
            zf.writestr(f"f{i}.txt", "x")
    with pytest.raises(LoraUnavailableError, match="more than 64 entries"):
        unpack(pack, tmp_path / "out")


def test_least_recently_used_packs_are_evicted_under_the_budget(tmp_path, adapters):
    served = tmp_path / "served"
    served.mkdir()
    md5 = {n: build_pack(adapters[n], served / f"{n}.tar.gz") for n in ("attn", "mlp")}
    with PackServer(served) as server:
        # room for the larger of the two unpacked adapters, not for both
        budget = int(max((adapters[n] / "adapter_model.safetensors").stat().st_size for n in ("attn", "mlp")) * 1.2)
        store = LoraStore(tmp_path / "cache", [server.url("/packs/")], StoreLimits(disk_budget_bytes=budget))

        async def go():
            k1, _ = await store.fetch(server.url("/packs/attn.tar.gz"), md5["attn"])
            k2, _ = await store.fetch(server.url("/packs/mlp.tar.gz"), md5["mlp"])
            return k1, k2

        k1, k2 = asyncio.run(go())
    names = {p.name for p in store.entries()}
    assert k2 in names and k1 not in names  # the older pack made room for the newer one
    assert store.num_downloads == 2


def test_a_bomb_writes_nothing_and_a_directory_flood_stops_at_the_entry_limit(tmp_path):
    """Limits are checked before anything is written: a member over the unpacked-size cap writes no byte,
    and a pack of 20,000 directories creates at most the entry limit's worth before it is refused."""
    import io
    import tarfile

    from lora_store.pack import UnpackLimits

    bomb = tmp_path / "bomb.tar.gz"
    with tarfile.open(bomb, "w:gz") as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = 64 << 20
        tar.addfile(info, io.BytesIO(bytes(64 << 20)))
    limits = UnpackLimits.for_pack_limit(max_pack_bytes=bomb.stat().st_size, disk_budget_bytes=1 << 30)
    assert limits.max_total_bytes == 4 * bomb.stat().st_size  # the stated ratio
    with pytest.raises(LoraUnavailableError, match="larger than"):
        unpack(bomb, tmp_path / "out", limits)
    written = sum(f.stat().st_size for f in (tmp_path / "out").rglob("*") if f.is_file())
    assert written == 0

    flood = tmp_path / "dirs.tar.gz"
    with tarfile.open(flood, "w:gz") as tar:
        for i in range(20000):
            info = tarfile.TarInfo(f"d{i}")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
    with pytest.raises(LoraUnavailableError, match="more than 64 entries"):
        unpack(flood, tmp_path / "out2")
    assert sum(1 for _ in (tmp_path / "out2").rglob("*")) <= 64


@pytest.mark.parametrize("label, entries, needle", [
    ("a directory, then a file of its name", [("a", None), ("a", b"x")], "'a' is both a file and a directory"),
    ("a file, then a directory of its name", [("a", b"x"), ("a/", None)], "'a' is both a file and a directory"),
    ("a path through a file", [("a", b"x"), ("a/b", b"y")], "'a/b' goes through 'a', which is a file"),
    ("a deeper path through a file", [("d/a", b"x"), ("d/a/b/c", b"y")], "goes through 'd/a'"),
    ("a 300-character name", [("n" * 300, b"x")], "over 255 bytes"),
    ("a file twice", [("f", b"x"), ("f", b"y")], "'f' appears twice"),
])
def test_a_layout_the_filesystem_cannot_hold_is_an_invalid_pack(tmp_path, label, entries, needle):
    """Each raised OSError (EISDIR, ENOTDIR, EEXIST, ENAMETOOLONG) while unpacking, an HTTP 500 before."""
    for kind in ("tar", "zip"):
        if kind == "zip" and any(data is None for _, data in entries):
            continue
        pack = tmp_path / f"{kind}.pack"
        if kind == "tar":
            write_tar(pack, entries)
        else:
            with zipfile.ZipFile(pack, "w") as zf:
                for name, data in entries:
                    zf.writestr(name, data)
        with pytest.raises(LoraUnavailableError, match=needle) as err:
            unpack(pack, tmp_path / f"out-{kind}")
        assert err.value.code == "invalid_pack"


def test_a_layout_error_the_checks_miss_is_still_an_invalid_pack(tmp_path, monkeypatch):
    """The filesystem's own refusal of an entry (here: a path over the OS limit slipped past a raised
    MAX_PATH_BYTES) is the invalid-pack error naming the entry; a full disk is not the pack's fault."""
    from lora_store import pack as pack_mod

    monkeypatch.setattr(pack_mod, "MAX_PATH_BYTES", 1 << 20)
    deep = "/".join(["d" * 200] * 30)  # 6,000 bytes: ENAMETOOLONG
    pack = write_tar(tmp_path / "deep.tar", [(deep, b"x")])
    with pytest.raises(LoraUnavailableError, match="cannot be unpacked") as err:
        unpack(pack, tmp_path / "out")
    assert err.value.code == "invalid_pack" and deep[:50] in str(err.value)


def test_a_pack_unpacks_to_at_most_four_times_its_own_size(tmp_path, adapters):
    """The limit follows the pack, not the largest pack the server accepts: a 20 KiB pack holding 16 MiB
    of zeros is refused under limits that would let a 512 MiB pack unpack to 2 GiB, before a byte is
    written; a real adapter's pack unpacks under the same limits."""
    import gzip

    from lora_store.pack import UnpackLimits

    limits = UnpackLimits.for_pack_limit(max_pack_bytes=512 << 20, disk_budget_bytes=4 << 30)
    raw = write_tar(tmp_path / "zeros.tar", [("adapter_config.json", b"{}"),
                                        ("adapter_model.safetensors", bytes(16 << 20))])
    bomb = tmp_path / "zeros.tar.gz"
    bomb.write_bytes(gzip.compress(raw.read_bytes(), compresslevel=9))
    assert bomb.stat().st_size < 64 << 10
    with pytest.raises(LoraUnavailableError, match="4x its own") as err:
        unpack(bomb, tmp_path / "out", limits)
    assert err.value.code == "invalid_pack"
    assert sum(f.stat().st_size for f in (tmp_path / "out").rglob("*") if f.is_file()) <= 2
    real = tmp_path / "real.tar.gz"
    build_pack(adapters["mlp"], real)
    adapter = unpack(real, tmp_path / "real", limits)
    assert (adapter / "adapter_model.safetensors").is_file()
