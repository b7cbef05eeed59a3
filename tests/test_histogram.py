"""Density histograms: exact counts on analytic layouts, periodic boundaries, snapshot files."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from preprocessing import histogram
from preprocessing.histogram import count_cic, count_ngp, histogram_snapshot
from workflow.errors import PipelineError


def lattice(n_side: int, box_size: float) -> np.ndarray:
    """Cell-centred Lagrangian lattice q = (i + 0.5) L / N in C order, (N^3, 3) Mpc/h."""
    return (np.indices((n_side,) * 3).reshape(3, -1).T + 0.5) * box_size / n_side


def write_snapshot(path, positions, box_size, redshifts, sim_id=3, dtype="<f4") -> None:
    """A snapshot.h5 per the contract: positions (n_z, N^3, 3) float32 in Mpc/h."""
    positions = np.asarray(positions, dtype)
    n_side = round(positions.shape[1] ** (1 / 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f["positions"] = positions
        f["velocities"] = np.zeros_like(positions)
        f["redshifts"] = np.asarray(redshifts, np.float64)
        f.attrs.update(sim_id=sim_id, seed=11, n_particles=n_side, box_size=box_size,
                       Omega_m=0.3, Omega_b=0.049, h=0.7, sigma_8=0.8, n_s=0.96)


@pytest.mark.parametrize("box_size", [64.0, 100.0, 333.3])
def test_lattice_gives_particles_per_voxel_exactly(box_size):
    # N = 2G particles per side: every voxel holds 2^3 lattice points, wherever the voxel edges
    # fall in floating point, also after a uniform shift of the whole lattice by < 1 spacing.
    n_side, grid = 16, 8
    q = lattice(n_side, box_size)
    for shift in (0.0, 0.49, -0.49):
        counts = count_ngp(q + shift * box_size / n_side, box_size, grid)
        assert counts.dtype == np.int32
        np.testing.assert_array_equal(counts, 8)


def test_boundary_positions_land_in_the_right_voxel():
    box_size, grid = 100.0, 10  # 10 Mpc/h voxels; 100 / 10 is not a power of two
    cases = {
        0.0: 0, 9.999: 0, 10.0: 1, 99.99: 9,
        100.0: 0,  # exactly L wraps to voxel 0
        -1e-6: 9,  # a tiny negative float (rounding of a periodic wrap) belongs to the last voxel
        np.nextafter(np.float32(100.0), np.float32(0.0)): 9,  # largest float32 below L
        250.0: 5, -95.0: 0,  # far outside the box: wrapped periodically
    }
    for x, expected in cases.items():
        positions = np.array([[x, 55.0, 0.0]], np.float32)
        counts = count_ngp(positions, box_size, grid)
        assert counts.sum() == 1
        assert tuple(np.argwhere(counts)[0]) == (expected, 5, 0), x


def test_random_positions_match_floor_formula():
    rng = np.random.default_rng(5)
    box_size, grid = 50.0, 12
    positions = rng.uniform(-box_size, 2 * box_size, (20_000, 3)).astype(np.float32)
    cells = np.floor(np.mod(positions.astype(np.float64), box_size) * grid / box_size).astype(int)
    expected = np.zeros((grid,) * 3, int)
    np.add.at(expected, tuple(cells.T), 1)
    np.testing.assert_array_equal(count_ngp(positions, box_size, grid), expected)


def test_counts_accumulate_into_out_for_any_memory_layout():
    rng = np.random.default_rng(1)
    positions = rng.uniform(0, 10.0, (5000, 3))
    out = count_ngp(positions[:1400], 10.0, 4)
    count_ngp(np.asfortranarray(positions[1400:]), 10.0, 4, out=out)
    np.testing.assert_array_equal(out, count_ngp(positions, 10.0, 4))
    assert out.sum() == 5000


def test_non_finite_positions_are_refused():
    positions = np.array([[1.0, 2.0, 3.0], [np.nan, 1.0, 1.0], [1.0, np.inf, 1.0]])
    with pytest.raises(ValueError, match="2 of 3 particle positions are not finite"):
        count_ngp(positions, 10.0, 4)


def test_cic_agrees_with_ngp_on_mass_and_voxel_centres():
    box_size, grid = 32.0, 8
    # Particles at voxel centres: the CIC cloud coincides with its voxel, so CIC = NGP = 1.
    centres = lattice(grid, box_size)
    np.testing.assert_allclose(count_cic(centres, box_size, grid), 1.0, atol=1e-6)
    np.testing.assert_array_equal(count_ngp(centres, box_size, grid), 1)
    # A particle on a voxel corner shares its unit mass equally among the 8 voxels around it.
    corner = count_cic(np.array([[4.0, 4.0, 4.0]]), box_size, grid)
    np.testing.assert_allclose(corner[:2, :2, :2], 1 / 8, rtol=1e-6)
    assert corner.sum() == pytest.approx(1.0)
    rng = np.random.default_rng(2)
    positions = rng.uniform(0, box_size, (5000, 3))
    assert count_cic(positions, box_size, grid).sum() == pytest.approx(5000, rel=1e-6)
    assert count_ngp(positions, box_size, grid).sum() == 5000


@pytest.mark.parametrize("stored_dtype", ["<f4", ">f8"])  # raw file reads; reads through h5py
def test_histogram_snapshot_writes_the_contract(tmp_path, monkeypatch, stored_dtype):
    # Small chunks, so the chunked and prefetched reading path is exercised.
    monkeypatch.setattr(histogram, "CHUNK_PARTICLES", 1000)
    rng = np.random.default_rng(3)
    box_size, n_side, grid = 40.0, 16, 8
    q = lattice(n_side, box_size)
    positions = np.stack([q, np.mod(q + rng.normal(0, 3.0, q.shape), box_size)])
    snapshot = tmp_path / "sims/00003/snapshot.h5"
    write_snapshot(snapshot, positions, box_size, [1.0, 0.0], dtype=stored_dtype)
    out = histogram_snapshot(snapshot, tmp_path / "histograms/00003.h5", grid, "ngp", "int16")
    with h5py.File(out, "r") as f:
        counts = f["counts"][()]
        attrs = dict(f.attrs)
    assert counts.shape == (2, grid, grid, grid) and counts.dtype == np.int16
    np.testing.assert_array_equal(counts[0], 8)  # the unperturbed lattice at z = 1
    np.testing.assert_array_equal(counts[1], count_ngp(positions[1].astype(np.float32), box_size, grid))
    assert counts.reshape(2, -1).sum(axis=1).tolist() == [n_side**3] * 2
    assert attrs["grid"] == grid and attrs["box_size"] == box_size
    assert attrs["assignment"] == "ngp" and attrs["dtype"] == "int16" and attrs["sim_id"] == 3
    np.testing.assert_array_equal(attrs["redshifts"], [1.0, 0.0])
    assert attrs["Omega_m"] == 0.3 and attrs["n_particles"] == n_side
    assert not list(out.parent.glob(".*"))  # no temporary file left behind


def test_histogram_snapshot_cic(tmp_path):
    rng = np.random.default_rng(4)
    positions = rng.uniform(0, 20.0, (1, 8**3, 3))
    write_snapshot(tmp_path / "snapshot.h5", positions, 20.0, [0.0])
    out = histogram_snapshot(tmp_path / "snapshot.h5", tmp_path / "h.h5", 4, "cic", "float32")
    with h5py.File(out, "r") as f:
        assert f["counts"].dtype == np.float32 and f.attrs["assignment"] == "cic"
        assert f["counts"][()].sum() == pytest.approx(8**3, rel=1e-6)
    with pytest.raises(PipelineError, match="int16.*CIC.*float32"):
        histogram_snapshot(tmp_path / "snapshot.h5", tmp_path / "h.h5", 4, "cic", "int16")


def test_int16_overflow_names_the_sim_and_suggests_int32(tmp_path):
    # 32^3 = 32768 particles in one voxel: one more than int16 holds.
    positions = np.full((1, 32**3, 3), 1.0)
    write_snapshot(tmp_path / "snapshot.h5", positions, 10.0, [0.0], sim_id=17)
    with pytest.raises(PipelineError, match=r"Sim 17 .*snapshot\.h5.* 32768 particles.*int32"):
        histogram_snapshot(tmp_path / "snapshot.h5", tmp_path / "h.h5", 4, "ngp", "int16")
    assert not (tmp_path / "h.h5").exists()
    out = histogram_snapshot(tmp_path / "snapshot.h5", tmp_path / "h.h5", 4, "ngp", "int32")
    with h5py.File(out, "r") as f:
        assert f["counts"][0, 0, 0, 0] == 32768


def test_missing_snapshot_is_named(tmp_path):
    missing = tmp_path / "sims/00009/snapshot.h5"
    with pytest.raises(PipelineError, match=r"00009/snapshot\.h5 does not exist"):
        histogram_snapshot(missing, tmp_path / "h.h5", 4, "ngp", "int16")


@pytest.mark.parametrize("keep_fraction", [0.5, 0.001])
def test_truncated_snapshot_is_named(tmp_path, keep_fraction):
    snapshot = tmp_path / "snapshot.h5"
    write_snapshot(snapshot, lattice(16, 10.0)[None], 10.0, [0.0])
    data = snapshot.read_bytes()
    snapshot.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(PipelineError, match=r"snapshot\.h5.*(truncated|corrupt)"):
        histogram_snapshot(snapshot, tmp_path / "h.h5", 4, "ngp", "int16")
    assert not (tmp_path / "h.h5").exists()


def test_corrupt_compressed_chunk_is_named(tmp_path):
    # The file opens, but one gzip chunk of positions no longer decompresses.
    snapshot = tmp_path / "snapshot.h5"
    with h5py.File(snapshot, "w") as f:
        f.create_dataset("positions", data=lattice(16, 10.0)[None].astype(np.float32),
                         chunks=(1, 512, 3), compression="gzip")
        f["redshifts"] = [0.0]
        f.attrs.update(sim_id=1, n_particles=16, box_size=10.0)
        chunk = f["positions"].id.get_chunk_info(3)
    with open(snapshot, "r+b") as handle:
        handle.seek(chunk.byte_offset + 10)
        handle.write(b"\xff" * 50)
    with pytest.raises(PipelineError, match=r"snapshot\.h5 could not be read"):
        histogram_snapshot(snapshot, tmp_path / "h.h5", 4, "ngp", "int16")


def test_snapshot_off_contract_is_refused(tmp_path):
    snapshot = tmp_path / "snapshot.h5"
    write_snapshot(snapshot, lattice(4, 10.0)[None], 10.0, [0.0, 1.0])  # 1 grid, 2 redshifts
    with pytest.raises(PipelineError, match=r"positions of shape \(1, 64, 3\); expected \(2, 64, 3\)"):
        histogram_snapshot(snapshot, tmp_path / "h.h5", 4, "ngp", "int16")
    for arguments, named in [((4, "tsc", "int16"), "assignment = 'tsc'"),
                             ((4, "ngp", "int8"), "dtype = 'int8'"), ((0, "ngp", "int16"), "grid = 0")]:
        with pytest.raises(PipelineError, match=named):
            histogram_snapshot(snapshot, tmp_path / "h.h5", *arguments)
