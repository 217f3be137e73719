"""Reference-image validation: every bad input the CLI must refuse, every mode it converts.

The helpers at the top write real files (built from scikit-learn's bundled photographs) and
are reused by tests/test_cli_errors.py.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_sample_image

from nw_adapter.correlate.images import (
    ImageInputError,
    collect_image_paths,
    load_reference_image,
    validate_images,
)


def photo(name: str = "china.jpg", size: int = 64) -> Image.Image:
    """A real photograph from scikit-learn, downscaled to ``size`` px on the long side."""
    img = Image.fromarray(load_sample_image(name))
    img.thumbnail((size, size))
    return img


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png16_rgb(path: Path, array: np.ndarray) -> Path:
    """Write a 16-bit-per-channel RGB PNG by hand (Pillow cannot write one)."""
    height, width, _ = array.shape
    raw = b"".join(b"\x00" + array[row].astype(">u2").tobytes() for row in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(raw))
        + _png_chunk(b"IEND", b"")
    )
    return path


def write_bomb_png(path: Path, side: int = 20000) -> Path:
    """A PNG whose header claims side x side pixels (a decompression bomb), with tiny data."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + _png_chunk(b"IEND", b"")
    )
    return path


def make_bad_file(kind: str, folder: Path) -> Path:
    """Create one bad input of the given kind inside ``folder`` and return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "missing":
        return folder / "does_not_exist.png"
    if kind == "directory":
        target = folder / "a_folder.png"
        target.mkdir()
        return target
    if kind == "zero_bytes":
        target = folder / "empty.png"
        target.write_bytes(b"")
        return target
    if kind == "not_an_image":
        target = folder / "notes.png"
        target.write_text("this is a text file, not a picture\n")
        return target
    if kind in ("truncated_png", "truncated_jpeg"):
        fmt, suffix = ("PNG", ".png") if kind == "truncated_png" else ("JPEG", ".jpg")
        full = folder / f"full{suffix}"
        photo(size=128).save(full, format=fmt)
        data = full.read_bytes()
        full.unlink()
        target = folder / f"truncated{suffix}"
        target.write_bytes(data[: len(data) // 2])
        return target
    if kind == "animated_gif":
        target = folder / "animated.gif"
        frames = [photo("china.jpg", 32).convert("P"), photo("flower.jpg", 32).resize((32, 21)).convert("P")]
        frames[1] = frames[1].resize(frames[0].size)
        frames[0].save(target, save_all=True, append_images=frames[1:], duration=100, loop=0)
        return target
    if kind == "bomb":
        return write_bomb_png(folder / "bomb.png")
    raise ValueError(kind)


BAD_KINDS = (
    "missing",
    "directory",
    "zero_bytes",
    "not_an_image",
    "truncated_png",
    "truncated_jpeg",
    "animated_gif",
    "bomb",
)

EXPECTED_WORDS = {
    "missing": "not found",
    "directory": "is a directory",
    "zero_bytes": "empty (0 bytes)",
    "not_an_image": "not an image",
    "truncated_png": "truncated or corrupt",
    "truncated_jpeg": "truncated or corrupt",
    "animated_gif": "animated image with 2 frames",
    "bomb": "decompression bomb",
}


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_inputs_raise_one_line_naming_the_file(kind: str, tmp_path: Path) -> None:
    path = make_bad_file(kind, tmp_path)
    with pytest.raises(ImageInputError) as info:
        load_reference_image(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    assert EXPECTED_WORDS[kind] in message
    assert ";" in message  # the fix follows the problem


def test_bomb_between_warning_and_error_level_is_refused(tmp_path: Path, monkeypatch) -> None:
    # 300 x 300 = 90 000 pixels: above a limit of 60 000 (warning level) but below 2x (error level).
    path = tmp_path / "big.png"
    photo(size=300).resize((300, 300)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 60_000)
    with pytest.raises(ImageInputError, match="decompression bomb"):
        load_reference_image(path)


def test_plain_rgb_photo_has_no_notes(tmp_path: Path) -> None:
    path = tmp_path / "china.jpg"
    source = photo()
    source.save(path, quality=95)
    rgb, info = load_reference_image(path)
    assert rgb.mode == "RGB" and rgb.size == source.size
    assert info.notes == () and info.mode == "RGB" and info.size == source.size
    assert info.key.startswith("china-") and len(info.sha256) == 64


def test_16bit_grayscale_is_scaled_not_clipped(tmp_path: Path) -> None:
    values = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    path = tmp_path / "gray16.png"
    Image.fromarray(values).save(path)
    rgb, info = load_reference_image(path)
    out = np.asarray(rgb)
    assert rgb.mode == "RGB" and info.mode.startswith("I")
    np.testing.assert_array_equal(out[..., 0], np.rint(values / 257).astype(np.uint8))
    assert any("16-bit" in note for note in info.notes)


def test_16bit_rgb_png_is_reduced_with_a_note(tmp_path: Path) -> None:
    base = np.asarray(photo(size=16)).astype(np.uint16)
    path = write_png16_rgb(tmp_path / "rgb16.png", base * 257)
    rgb, info = load_reference_image(path)
    np.testing.assert_array_equal(np.asarray(rgb), base.astype(np.uint8))
    assert any("16-bit RGB" in note for note in info.notes)


def test_cmyk_jpeg_is_converted(tmp_path: Path) -> None:
    path = tmp_path / "cmyk.jpg"
    photo().convert("CMYK").save(path, quality=95)
    rgb, info = load_reference_image(path)
    assert rgb.mode == "RGB" and info.mode == "CMYK"
    assert any("CMYK" in note for note in info.notes)


def test_palette_png_is_converted(tmp_path: Path) -> None:
    path = tmp_path / "palette.png"
    paletted = photo().convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    paletted.save(path)
    rgb, info = load_reference_image(path)
    assert info.mode == "P" and rgb.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(rgb), np.asarray(paletted.convert("RGB")))
    assert any("palette" in note for note in info.notes)


def test_rgba_is_composited_over_white(tmp_path: Path) -> None:
    rgba = photo().convert("RGBA")
    alpha = np.zeros(rgba.size[::-1], dtype=np.uint8)
    alpha[:, : rgba.size[0] // 2] = 255
    rgba.putalpha(Image.fromarray(alpha))
    path = tmp_path / "rgba.png"
    rgba.save(path)
    rgb, info = load_reference_image(path)
    out = np.asarray(rgb)
    assert (out[:, -1] == 255).all()  # fully transparent half -> white
    np.testing.assert_array_equal(out[:, 0], np.asarray(rgba)[:, 0, :3])
    assert any("alpha" in note for note in info.notes)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    source = photo()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    path = tmp_path / "rotated.jpg"
    source.save(path, exif=exif, quality=95)
    rgb, info = load_reference_image(path)
    assert rgb.size == source.size[::-1]
    assert any(note.startswith("EXIF orientation 6 applied") for note in info.notes)


def test_invalid_exif_orientation_is_not_claimed_as_applied(tmp_path: Path) -> None:
    source = photo()
    exif = Image.Exif()
    exif[0x0112] = 99
    path = tmp_path / "odd.jpg"
    source.save(path, exif=exif, quality=95)
    rgb, info = load_reference_image(path)
    assert rgb.size == source.size
    assert not any("applied" in note for note in info.notes)
    assert any("orientation 99 is not a valid value" in note for note in info.notes)


@pytest.mark.parametrize("low_high", [(-5, 200), (0, 70000)])
def test_32bit_integer_outside_16_bits_is_refused(low_high: tuple[int, int], tmp_path: Path) -> None:
    values = np.linspace(*low_high, 16 * 16).reshape(16, 16).astype(np.int32)
    path = tmp_path / "int32.tif"
    Image.fromarray(values, mode="I").save(path)
    with pytest.raises(ImageInputError, match="32-bit integer image with values from") as info:
        load_reference_image(path)
    assert "int32.tif" in str(info.value) and "\n" not in str(info.value)


def test_32bit_integer_with_16bit_values_is_scaled_with_a_true_note(tmp_path: Path) -> None:
    values = np.linspace(0, 65535, 16 * 16).reshape(16, 16).astype(np.int32)
    path = tmp_path / "int32.tif"
    Image.fromarray(values, mode="I").save(path)
    rgb, info = load_reference_image(path)
    assert info.mode == "I"
    np.testing.assert_array_equal(np.asarray(rgb)[..., 0], np.rint(values / 257).astype(np.uint8))
    assert any(note.startswith("32-bit integer grayscale with 16-bit values") for note in info.notes)


@pytest.mark.parametrize("size", [(20000, 5), (5, 20000), (60000, 2)])
def test_extreme_aspect_ratio_is_refused_before_the_encoder(size: tuple[int, int], tmp_path: Path) -> None:
    path = tmp_path / "strip.png"
    Image.new("RGB", size, (120, 30, 200)).save(path)
    with pytest.raises(ImageInputError, match="aspect ratio") as info:
        load_reference_image(path)
    assert "crop it closer to square" in str(info.value)


def test_aspect_ratio_bound_is_on_the_resized_size() -> None:
    from nw_adapter.correlate.images import MAX_ENCODER_PIXELS, encoder_resized_size

    assert encoder_resized_size((20000, 5)) == (896000, 224)  # 200 M pixels: what the encoder would make
    width, height = encoder_resized_size((64 * 10, 10))  # the largest accepted ratio
    assert width * height <= MAX_ENCODER_PIXELS
    width, height = encoder_resized_size((65 * 10, 10))
    assert width * height > MAX_ENCODER_PIXELS


def test_symlink_loop_and_dangling_link_are_named(tmp_path: Path) -> None:
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop)
    with pytest.raises(ImageInputError, match="symbolic link loop"):
        load_reference_image(loop)
    dangling = tmp_path / "dangling.png"
    dangling.symlink_to(tmp_path / "gone.png")
    with pytest.raises(ImageInputError, match="dangling symbolic link"):
        load_reference_image(dangling)


def test_collect_scans_folders_sorted_and_skips_hidden(tmp_path: Path) -> None:
    folder = tmp_path / "refs"
    folder.mkdir()
    for name in ("b.png", "a.jpg", ".hidden.png", "readme.txt"):
        (folder / name).write_bytes(b"x")
    extra = tmp_path / "single.png"
    pairs = collect_image_paths([extra], [folder])
    assert [p.name for p, _ in pairs] == ["single.png", "a.jpg", "b.png"]
    assert [label for _, label in pairs] == ["--image", "--image-dir", "--image-dir"]


@pytest.mark.parametrize(
    ("setup", "words"),
    [("empty", "contains no images"), ("missing", "folder not found"), ("file", "is a file")],
)
def test_collect_rejects_bad_folders(setup: str, words: str, tmp_path: Path) -> None:
    target = tmp_path / "refs"
    if setup == "empty":
        target.mkdir()
        (target / "notes.txt").write_text("no pictures here")
    elif setup == "file":
        target.write_text("x")
    with pytest.raises(ImageInputError, match=words):
        collect_image_paths([], [target])


def test_nothing_given_is_an_error() -> None:
    with pytest.raises(ImageInputError, match="no reference image"):
        collect_image_paths([], [])


def test_validate_keeps_identical_files_once(tmp_path: Path) -> None:
    first = tmp_path / "x.png"
    photo().save(first)
    infos = validate_images([(first, "--image"), (first, "--image")])
    assert len(infos) == 1


def test_image_dir_symlink_loop_is_named(tmp_path: Path) -> None:
    loop = tmp_path / "refs"
    loop.symlink_to(loop)
    with pytest.raises(ImageInputError, match="--image-dir .*symbolic link loop"):
        collect_image_paths(image_dirs=[loop])


def test_one_content_under_two_names_is_one_reference_with_a_note(tmp_path: Path) -> None:
    first, copy, other = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    photo().save(first)
    copy.write_bytes(first.read_bytes())
    photo("flower.jpg").save(other)
    infos = validate_images([(first, "--image"), (copy, "--image-dir"), (other, "--image")])
    assert [info.path.name for info in infos] == ["a.png", "c.png"]
    assert infos[0].duplicates == (copy.resolve(),)
    assert infos[0].to_dict()["duplicates"] == 1 and "duplicates" not in infos[1].to_dict()
    assert any("b.png" in note and "counted once" in note for note in infos[0].notes)


@pytest.mark.parametrize("side", [20000, 11000])  # error level (Pillow: 2x its limit), warning level
def test_bomb_message_states_one_limit_once(side: int, tmp_path: Path) -> None:
    import re

    path = write_bomb_png(tmp_path / "bomb.png", side)
    with pytest.raises(ImageInputError) as info:
        load_reference_image(path)
    message = str(info.value)
    limits = {int(n) for n in re.findall(r"(\d{5,}) pixels", message)} - {side * side}
    assert limits == {Image.MAX_IMAGE_PIXELS}, message
    assert message.count(str(Image.MAX_IMAGE_PIXELS)) == 1, message
    assert f"{side * side} pixels" in message, message  # the image's own size, beside the limit


def test_compare_swap_counts_one_content_under_two_names_once(tmp_path: Path, capsys) -> None:
    from nw_adapter.correlate.cli import main
    from nw_adapter.models.tiny_digits import example_image_path

    first, copy = tmp_path / "a.png", tmp_path / "b.png"
    first.write_bytes(example_image_path(3).read_bytes())
    copy.write_bytes(first.read_bytes())
    argv = ["--compare-swap", "--model", "tiny", "--image", str(first), "--image", str(copy)]
    code = main([*argv, "--labels", "3,3", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "2 label(s) for 1 distinct reference image" in err, err
    assert "b.png has the same content (SHA-256); counted once, as a.png" in err
