"""Tensor sources: image folders, numpy files and audio folders, seeded, hashed, split, checked for
overlap like the text sources; bad folders and files are one DataError."""

from __future__ import annotations

import re

import numpy as np
import pytest

import calibration
from calibration import DataError
from tests.support.audio import write_silence, write_wavs


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Real photographs (scikit-image's wheel) copied as JPEG and PNG, plus a file that is not an image."""
    from PIL import Image
    from skimage import data

    folder = tmp_path_factory.mktemp("photos")
    pictures = {
        "astronaut": data.astronaut(),
        "coffee": data.coffee(),
        "chelsea": data.chelsea(),
        "camera": data.camera(),
    }
    for i, (name, pixels) in enumerate(pictures.items()):
        Image.fromarray(pixels).save(folder / (f"{name}.jpg" if i % 2 else f"{name}.png"))
    (folder / "notes.txt").write_text("not an image")
    return folder


def load(split, count, folder, seed=0, **image):
    return calibration.load("image_folder", split, count, seed, path=str(folder), image=image)


def test_image_folder_resizes_normalizes_and_lays_out(photos):
    both = sum(load(split, 1, photos, size=[8, 8]).available for split in ("calibration", "evaluation"))
    assert both == 4  # every picture in exactly one split; notes.txt is not an image
    data = load("calibration", 1, photos, size=[32, 48], mean=[0.5] * 3, std=[0.25] * 3)
    item = data.items[0]
    assert item.shape == (3, 32, 48) and item.dtype == np.float32
    assert -2.0 <= item.min() < item.max() <= 2.0  # (x/255 - 0.5) / 0.25
    nhwc = load("calibration", 1, photos, size=[32, 48], layout="NHWC").items[0]
    assert nhwc.shape == (32, 48, 3) and 0 <= nhwc.min() and nhwc.max() <= 1
    gray = load("calibration", 1, photos, size=[16, 16], channels="L").items[0]
    assert gray.shape == (1, 16, 16)
    rgb = load("calibration", 1, photos, size=[16, 16]).items[0]
    bgr = load("calibration", 1, photos, size=[16, 16], channels="BGR").items[0]
    assert np.array_equal(rgb[::-1], bgr)
    assert data.describe()["image"]["size"] == [32, 48] and data.describe()["item_shape"] == [3, 32, 48]


def test_letterbox_keeps_the_aspect_ratio_and_pads(photos):
    item = load("calibration", 1, photos, seed=0, size=[64, 64], resize="letterbox", pad=0.0, files="chelsea*").items
    # chelsea is 451x300 (wider than tall): rows above and below the picture are padding (0).
    assert item[0].shape == (3, 64, 64)
    assert np.all(item[0][:, 0, :] == 0) and np.all(item[0][:, -1, :] == 0) and item[0][:, 32, :].max() > 0


def test_tiles_are_split_by_their_pixels_and_never_overlap(photos):
    cal = load("calibration", 1, photos, size=[64, 64], tile=True)
    ev = load("evaluation", 1, photos, size=[64, 64], tile=True)
    everything_cal = load("calibration", cal.available, photos, size=[64, 64], tile=True)
    everything_ev = load("evaluation", ev.available, photos, size=[64, 64], tile=True)
    assert not set(everything_cal.item_hashes) & set(everything_ev.item_hashes)
    # 64x64 tiles: astronaut and camera 512x512 -> 8x8 each, coffee 600x400 -> 9x6, chelsea 451x300 -> 7x4.
    assert cal.available + ev.available == 64 + 64 + 54 + 28
    assert everything_cal.items[0].shape == (3, 64, 64)


def test_sampling_is_seeded_and_overlap_is_refused(photos):
    a, b, c = (load("calibration", 2, photos, seed=s, size=[16, 16]) for s in (1, 1, 2))
    assert a.sha256 == b.sha256 and a.describe()["count"] == 2
    assert (a.describe()["seed"], c.describe()["seed"]) == (1, 2)
    with pytest.raises(DataError, match="also appear in the calibration"):
        calibration.remove_overlap(a, load("calibration", 2, photos, seed=1, size=[16, 16]), "error")


def test_bad_image_folders_are_one_error(tmp_path, photos):
    with pytest.raises(DataError, match="does not exist"):
        load("calibration", 1, tmp_path / "nowhere")
    (tmp_path / "file.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="not a directory"):
        load("calibration", 1, tmp_path / "file.png")
    with pytest.raises(DataError, match="cannot be decoded"):
        for split in ("calibration", "evaluation"):
            load(split, 1, tmp_path)
    with pytest.raises(DataError, match="different sizes"):
        for split in ("calibration", "evaluation"):
            load(split, 1, photos)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no image files"):
        load("calibration", 1, empty)
    for bad, message in (
        ({"layout": "CHWN"}, "layout"),
        ({"tile": True}, "needs image.size"),
        ({"mean": [0.5, 0.5]}, "2 values for 3 channels"),
        ({"std": [0, 1, 1]}, "positive"),
    ):
        with pytest.raises(DataError, match=message):
            load("calibration", 1, photos, **bad)


def test_package_paths_resolve_without_import():
    data = calibration.load(
        "image_folder", "calibration", 2, 0, path="pkg://skimage/data", image={"files": "*.png", "size": [8, 8]}
    )
    assert len(data.items) == 2 and data.describe()["path"] == "pkg://skimage/data"
    with pytest.raises(DataError, match="not installed"):
        calibration.load("image_folder", "calibration", 1, 0, path="pkg://no_such_package_here/x")


def test_npy_and_npz_items_along_axis_0(tmp_path):
    arrays = np.random.default_rng(0).standard_normal((40, 3, 8)).astype(np.float32)
    np.save(tmp_path / "items.npy", arrays)
    np.savez(tmp_path / "one.npz", arrays)
    np.savez(tmp_path / "two.npz", features=arrays, other=arrays[:, :1])
    cal = calibration.load("npy", "calibration", 5, 0, path=str(tmp_path / "items.npy"))
    ev = calibration.load("npy", "evaluation", 1, 0, path=str(tmp_path / "items.npy"))
    assert cal.available + ev.available == 40 and cal.items[0].shape == (3, 8)
    assert any(np.array_equal(cal.items[0], a) for a in arrays)
    assert calibration.load("npy", "calibration", 5, 0, path=str(tmp_path / "one.npz")).sha256 == cal.sha256
    picked = calibration.load("npy", "calibration", 5, 0, path=str(tmp_path / "two.npz"), field="features")
    assert picked.sha256 == cal.sha256
    with pytest.raises(DataError, match="name one with calibration.field"):
        calibration.load("npy", "calibration", 1, 0, path=str(tmp_path / "two.npz"))


def test_npy_never_unpickles(tmp_path):
    objects = np.array([{"a": 1}, {"b": 2}], dtype=object)
    np.save(tmp_path / "objects.npy", objects, allow_pickle=True)
    with pytest.raises(DataError, match="without pickled objects"):
        calibration.load("npy", "calibration", 1, 0, path=str(tmp_path / "objects.npy"))


def test_audio_folder_resamples_and_windows_by_file(tmp_path):
    write_wavs(tmp_path / "wavs", 12, seconds=1.0, rate=44100)
    options = {"sample_rate": 16000, "samples": 4000}
    cal = calibration.load("audio_folder", "calibration", 4, 0, path=str(tmp_path / "wavs"), audio=options)
    ev = calibration.load("audio_folder", "evaluation", 1, 0, path=str(tmp_path / "wavs"), audio=options)
    assert (cal.available + ev.available) == 12 * 4  # 1 s at 16 kHz = four 4000-sample windows per file
    assert cal.items[0].shape == (4000,) and cal.items[0].dtype == np.float32
    assert cal.describe()["audio"] == {"sample_rate": 16000, "samples": 4000, "hop": 4000}
    half = calibration.load(
        "audio_folder", "calibration", 1, 0, path=str(tmp_path / "wavs"), audio=dict(options, hop=2000)
    )
    assert half.available == cal.available // 4 * 7  # windows every 2000 samples: 7 per file
    # Resampling kept the signal: a 44.1 kHz file read at 16 kHz has the same duration and a similar level.
    assert 0.05 < float(np.abs(np.concatenate(cal.items)).mean()) < 0.8


def test_bad_audio_is_one_error(tmp_path):
    (tmp_path / "broken.wav").write_bytes(b"RIFF....WAVEfmt nope")
    with pytest.raises(DataError, match="cannot be decoded"):
        for split in ("calibration", "evaluation"):
            calibration.load("audio_folder", split, 1, 0, path=str(tmp_path))
    with pytest.raises(DataError, match="positive"):
        calibration.load("audio_folder", "calibration", 1, 0, path=str(tmp_path), audio={"samples": 0})


def peak_bytes(action) -> int:
    """The most memory Python and numpy held while `action` ran (numpy reports its buffers to tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        action()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def refused_with_little_memory(folder, match: str, **audio) -> None:
    """Both splits loaded (a lone file falls in one of them, the other is empty): one DataError naming
    the file, raised from the header, before the decoded or resampled wave is allocated."""
    refusals = []

    def load_both():
        for split in ("calibration", "evaluation"):
            try:
                calibration.load("audio_folder", split, 1, 0, path=str(folder), audio=audio)
            except DataError as exc:
                refusals.append(str(exc))

    # Reading a file reserves a buffer of the data size limit; past that, 16 MiB for everything else.
    assert peak_bytes(load_both) < calibration.max_data_bytes() + 16 * 2**20
    assert [r for r in refusals if re.search(match, r)], refusals


def test_a_rate_outside_audio_rates_is_refused_before_resampling(tmp_path):
    # 20 KB declaring 1 Hz: resampled to 16 kHz it would be 160 million samples (1.3 GB).
    (path,) = write_wavs(tmp_path / "wavs", 1, seconds=10_000, rate=1)
    assert path.stat().st_size < 25_000
    refused_with_little_memory(tmp_path / "wavs", r"clip00.wav declares 1 Hz, outside 1000 \.\. 384000 Hz")
    write_wavs(tmp_path / "ok", 1, seconds=0.1, rate=16000)
    with pytest.raises(DataError, match=r"audio.sample_rate=10000000 \(use 1000 \.\. 384000 Hz\)"):
        calibration.load("audio_folder", "calibration", 1, 0, path=str(tmp_path / "ok"), audio={"sample_rate": 10**7})


def test_a_recording_that_decodes_past_the_limit_is_refused_from_its_header(tmp_path):
    from calibration.media import MAX_AUDIO_SAMPLES

    # 100 KB of FLAC silence that decodes to 2**25 + 1 samples (128 MiB of float32).
    path = write_silence(tmp_path / "long" / "silence.flac", MAX_AUDIO_SAMPLES + 1, rate=16000)
    assert path.stat().st_size < 200_000
    refused_with_little_memory(
        tmp_path / "long", rf"silence.flac has {MAX_AUDIO_SAMPLES + 1} frames x 1 channels .* samples per file"
    )
    # Channels count: 8 channels of a quarter of the limit decode to twice it.
    write_silence(tmp_path / "wide" / "eight.flac", MAX_AUDIO_SAMPLES // 4, rate=16000, channels=8)
    refused_with_little_memory(tmp_path / "wide", r"eight.flac has \d+ frames x 8 channels")


def test_a_recording_that_resamples_past_the_limit_is_refused_before_resampling(tmp_path):
    from calibration.media import MAX_AUDIO_SAMPLES

    # 175 KB at 1 kHz, within the limit as decoded; at 384 kHz it would be 384 times longer.
    frames = MAX_AUDIO_SAMPLES // 384 + 1
    write_silence(tmp_path / "slow" / "slow.wav", frames, rate=1000)
    refused_with_little_memory(
        tmp_path / "slow",
        rf"slow.wav has {frames} frames .* \({frames * 384} samples at 384000 Hz\)",
        sample_rate=384000,
    )
