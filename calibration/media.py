"""Ready tensors for models that take them: image folders, numpy files and audio folders.

Each item is one sample's array (without the batch axis) as the model's data input takes it, so the
same array hashes alike in calibration and evaluation and the overlap check works as for text:
- image_folder: pictures decoded with Pillow, converted to RGB/BGR/L, resized (stretch or
  letterbox) or cut into tiles, scaled to 0..1, normalized with the recipe's mean/std, NCHW or NHWC.
  Whole files go to one split by a hash of their bytes; with tiling, tiles are split by their pixels.
- npy: a .npy array (items along axis 0) or one array of a .npz file (`field`), never unpickled.
- audio_folder: sound files decoded with soundfile, mixed to mono, resampled to the recipe's rate
  (scipy's polyphase filter) and cut into fixed windows; a recording's windows stay in one split.
  Rates outside MIN_SAMPLE_RATE..MAX_SAMPLE_RATE and files longer than MAX_AUDIO_SAMPLES, decoded
  or resampled, are refused from the file's header, before anything is decoded.

`path` may be pkg://PACKAGE/SUBPATH: a folder or file shipped inside an installed package.
"""

from __future__ import annotations

import importlib.util
import io
import os
import stat
from pathlib import Path

import numpy as np

from calibration import DataError, Labeled, _in_split, _read, source

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".aiff", ".aif")
MAX_FOLDER_FILES = 10_000
# Sample rates a recording or a model may have: below 1 kHz is not audio a model takes, and a
# header claiming 1 Hz would make resampling to 16 kHz multiply the file's length by 16000.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 384_000
# Samples per file, decoded (frames x channels) and after resampling: 128 MiB of float32, about
# 35 minutes at 16 kHz. Compressed files (FLAC of silence) decode to far more than their size.
MAX_AUDIO_SAMPLES = 2**25


def resolve_path(path: str | None) -> str | None:
    """pkg://name/sub/path -> the installed package's folder joined with sub/path (not imported)."""
    if not path or not path.startswith("pkg://"):
        return path
    package, _, sub = path[len("pkg://") :].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"data path {path}: package {package!r} is not installed")
    return str(Path(list(spec.submodule_search_locations)[0]) / sub)


def folder_files(path: str | None, suffixes: tuple[str, ...], kind: str, pattern: str = "*") -> list[Path]:
    """The regular files with these suffixes that match `pattern` in a folder (not recursive, sorted;
    links refused)."""
    if not path:
        raise DataError(f"this data source needs a path (a folder of {kind} files)")
    folder = Path(resolve_path(path) or "").expanduser()
    try:
        info = os.lstat(folder)
    except OSError:
        raise DataError(f"data folder {path} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise DataError(f"data folder {path} is not a directory; give a folder of {kind} files")
    files = sorted(
        p for p in folder.glob(pattern) if p.suffix.lower() in suffixes and not p.is_symlink() and p.is_file()
    )
    if not files:
        raise DataError(f"data folder {path} has no {kind} files matching {pattern} ({', '.join(suffixes)})")
    if len(files) > MAX_FOLDER_FILES:
        raise DataError(f"data folder {path} has {len(files)} {kind} files, over the limit of {MAX_FOLDER_FILES}")
    return files


def _content_key(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


# --- images ---------------------------------------------------------------------------------------


@source("image_folder")
def image_folder(split: str, path: str | None = None, image: dict | None = None, **_) -> Labeled:
    """Every picture of a folder as a normalized float32 array (see ImageOptions in the recipe schema)."""
    options = _image_options(image or {})
    items = []
    for file in folder_files(path, IMAGE_SUFFIXES, "image", options["files"]):
        data = _read(str(file))
        picture = _decode_image(data, file, options["channels"])
        if options["tile"]:
            items += [t for t in _tiles(picture, options["size"]) if _in_split(t, split)]
        elif _in_split(_content_key(data), split):
            items.append(_resize(picture, options))
    arrays = [_normalize(i, options) for i in items]
    sizes = sorted({a.shape for a in arrays})
    if len(sizes) > 1:
        raise DataError(f"images in {path} have different sizes {sizes[:3]}: set image.size=[height, width]")
    return Labeled(arrays, extra={"image": options, "item_shape": list(arrays[0].shape) if arrays else None})


def _image_options(given: dict) -> dict:
    options = {
        "size": None,
        "resize": "stretch",
        "tile": False,
        "layout": "NCHW",
        "channels": "RGB",
        "mean": [0.0, 0.0, 0.0],
        "std": [1.0, 1.0, 1.0],
        "pad": 0.0,
        "files": "*",
        **{k: v for k, v in given.items() if v is not None},
    }
    if options["size"] is not None:
        options["size"] = [int(v) for v in options["size"]]
        if len(options["size"]) != 2 or min(options["size"]) < 1:
            raise DataError(f"calibration image.size={options['size']} (give [height, width], both at least 1)")
    if options["resize"] not in ("stretch", "letterbox"):
        raise DataError(f"image.resize={options['resize']} (use stretch or letterbox)")
    if options["layout"] not in ("NCHW", "NHWC"):
        raise DataError(f"image.layout={options['layout']} (use NCHW or NHWC)")
    if options["channels"] not in ("RGB", "BGR", "L"):
        raise DataError(f"image.channels={options['channels']} (use RGB, BGR or L)")
    if options["tile"] and options["size"] is None:
        raise DataError("image.tile=true needs image.size=[height, width] (the tile size)")
    channels = 1 if options["channels"] == "L" else 3
    for key in ("mean", "std"):
        options[key] = [float(v) for v in options[key]]
        if len(options[key]) == 3 and channels == 1:
            options[key] = options[key][:1]
        if len(options[key]) != channels:
            raise DataError(f"image.{key} has {len(options[key])} values for {channels} channels")
    if min(options["std"]) <= 0:
        raise DataError(f"image.std={options['std']} (every value must be positive)")
    return options


def _decode_image(data: bytes, file: Path, channels: str) -> np.ndarray:
    """[H, W, C] uint8 in the recipe's channel order."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = np.asarray(img.convert("L" if channels == "L" else "RGB"))
    except UnidentifiedImageError:
        raise DataError(
            f"image {file} cannot be decoded: not a format Pillow reads (image.files selects files)"
        ) from None
    except (OSError, ValueError) as exc:
        raise DataError(f"image {file} cannot be decoded: {exc}") from None
    if channels == "L":
        return rgb[:, :, None]
    return rgb[:, :, ::-1] if channels == "BGR" else rgb


def _resize(picture: np.ndarray, options: dict) -> np.ndarray:
    from PIL import Image

    if options["size"] is None:
        return picture
    height, width = options["size"]
    img = Image.fromarray(picture.squeeze(-1) if picture.shape[-1] == 1 else picture)
    if options["resize"] == "stretch":
        out = np.asarray(img.resize((width, height), Image.Resampling.BILINEAR))
        return out[:, :, None] if out.ndim == 2 else out
    # Letterbox: the largest size that fits with the aspect ratio kept, centred on the padding.
    scale = min(height / picture.shape[0], width / picture.shape[1])
    inner = (max(1, round(picture.shape[1] * scale)), max(1, round(picture.shape[0] * scale)))
    resized = np.asarray(img.resize(inner, Image.Resampling.BILINEAR))
    resized = resized[:, :, None] if resized.ndim == 2 else resized
    canvas = np.full((height, width, picture.shape[-1]), round(options["pad"] * 255), dtype=np.uint8)
    top, left = (height - inner[1]) // 2, (width - inner[0]) // 2
    canvas[top : top + inner[1], left : left + inner[0]] = resized
    return canvas


def _tiles(picture: np.ndarray, size: list[int]) -> list[np.ndarray]:
    height, width = size
    return [
        np.ascontiguousarray(picture[y : y + height, x : x + width])
        for y in range(0, picture.shape[0] - height + 1, height)
        for x in range(0, picture.shape[1] - width + 1, width)
    ]


def _normalize(picture: np.ndarray, options: dict) -> np.ndarray:
    pixels = (picture.astype(np.float32) / 255 - np.float32(options["mean"])) / np.float32(options["std"])
    return np.ascontiguousarray(pixels.transpose(2, 0, 1) if options["layout"] == "NCHW" else pixels, np.float32)


# --- numpy files ----------------------------------------------------------------------------------


@source("npy")
def npy(split: str, path: str | None = None, field: str = "text", **_) -> Labeled:
    """Items along axis 0 of a .npy array, or of one array of a .npz file (`field` names it; a file
    with one array needs no name). Object arrays are refused: loading them would unpickle."""
    resolved = resolve_path(path)
    data = _read(resolved)
    try:
        loaded = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise DataError(f"data file {path} is not a numpy file without pickled objects: {exc}") from None
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            array = _npz_array(loaded, path, field)
    else:
        array = loaded
    if array.ndim < 1 or len(array) == 0:
        raise DataError(f"data file {path} holds no items (items are along axis 0)")
    items = [np.ascontiguousarray(a) for a in array]
    kept = [a for a in items if _in_split(a, split)]
    return Labeled(kept, extra={"item_shape": list(array.shape[1:]), "dtype": str(array.dtype)})


def _npz_array(archive, path: str | None, field: str) -> np.ndarray:
    names = list(archive.files)
    if field in names:
        return archive[field]
    if len(names) == 1 and field == "text":  # `field` left at its default: the only array
        return archive[names[0]]
    raise DataError(f"data file {path} has arrays {names}; name one with calibration.field=NAME")


# --- audio ----------------------------------------------------------------------------------------


@source("audio_folder")
def audio_folder(split: str, path: str | None = None, audio: dict | None = None, **_) -> Labeled:
    """Fixed windows of every sound file in a folder, mono float32 at the recipe's sample rate."""
    options = {"sample_rate": 16000, "samples": 16000, "hop": None, **{k: v for k, v in (audio or {}).items()}}
    rate, window = int(options["sample_rate"]), int(options["samples"])
    hop = int(options["hop"] or window)
    if min(rate, window, hop) < 1:
        raise DataError(f"audio sample_rate, samples and hop must be positive (got {rate}, {window}, {hop})")
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise DataError(f"audio.sample_rate={rate} (use {MIN_SAMPLE_RATE} .. {MAX_SAMPLE_RATE} Hz)")
    items = []
    for file in folder_files(path, AUDIO_SUFFIXES, "audio"):
        data = _read(str(file))
        if not _in_split(_content_key(data), split):
            continue
        wave = _decode_audio(data, file, rate)
        items += [np.ascontiguousarray(wave[i : i + window]) for i in range(0, len(wave) - window + 1, hop)]
    return Labeled(items, extra={"audio": {"sample_rate": rate, "samples": window, "hop": hop}})


def _decode_audio(data: bytes, file: Path, rate: int) -> np.ndarray:
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            file_rate = int(sound.samplerate)
            _check_audio_size(file, sound.frames, sound.channels, file_rate, rate)
            wave = sound.read(dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as exc:
        raise DataError(f"audio file {file} cannot be decoded: {exc}") from None
    mono = wave.mean(axis=1)
    if file_rate != rate:
        from math import gcd

        from scipy.signal import resample_poly

        divisor = gcd(file_rate, rate)
        mono = resample_poly(mono, rate // divisor, file_rate // divisor)
    return mono.astype(np.float32)


def _check_audio_size(file: Path, frames: int, channels: int, file_rate: int, rate: int) -> None:
    """Refuse from the header what decoding or resampling could not hold: read() allocates
    frames x channels, and resampling multiplies the length by rate / file_rate."""
    if not MIN_SAMPLE_RATE <= file_rate <= MAX_SAMPLE_RATE:
        raise DataError(f"audio file {file} declares {file_rate} Hz, outside {MIN_SAMPLE_RATE} .. {MAX_SAMPLE_RATE} Hz")
    decoded, resampled = frames * channels, -(-frames * rate // file_rate)
    if max(decoded, resampled) > MAX_AUDIO_SAMPLES:
        raise DataError(
            f"audio file {file} has {frames} frames x {channels} channels at {file_rate} Hz "
            f"({resampled} samples at {rate} Hz): over the limit of {MAX_AUDIO_SAMPLES} samples per file; "
            f"cut it into shorter files"
        )
