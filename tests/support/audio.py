"""WAV files for the audio tests, written with soundfile: no package that installs offline ships
recorded speech, so these are voiced-like segments (a gliding fundamental with decaying harmonics,
amplitude-modulated at a syllable rate) between pauses and noise, at a rate the source resamples;
and silence of any length, small on disk, for the limits on what a file may decode to."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def speechlike(seconds: float, rate: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 110 + 60 * rng.random() + 30 * np.sin(2 * np.pi * 0.7 * t)  # a gliding pitch
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    syllables = np.clip(np.sin(2 * np.pi * (3 + rng.random()) * t), 0, None)  # ~4 syllables per second
    pauses = (np.sin(2 * np.pi * 0.4 * t + rng.random() * 6) > -0.3).astype(float)  # silences between phrases
    wave = 0.3 * voiced * syllables * pauses + 0.01 * rng.standard_normal(len(t))
    return (wave / np.abs(wave).max() * 0.8).astype(np.float32)


def write_wavs(folder: Path, count: int, seconds: float = 2.0, rate: int = 44100) -> list[Path]:
    import soundfile

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"clip{i:02d}.wav"
        soundfile.write(str(path), speechlike(seconds, rate, i), rate)
        paths.append(path)
    return paths


def write_silence(path: Path, frames: int, rate: int, channels: int = 1) -> Path:
    """A recording of silence, written block by block: as FLAC it is tiny however long it is, the
    shape of a file whose decoded length is far beyond its size on disk."""
    import soundfile

    path.parent.mkdir(parents=True, exist_ok=True)
    block = np.zeros((min(frames, 2**20), channels), np.float32)
    with soundfile.SoundFile(str(path), "w", samplerate=rate, channels=channels) as sound:
        for start in range(0, frames, len(block)):
            sound.write(block[: frames - start])
    return path
