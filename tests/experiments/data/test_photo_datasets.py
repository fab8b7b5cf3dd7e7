"""Tests for experiments/data/photo_datasets.py."""

import os
import re

import numpy as np
import pytest
from PIL import Image
from PIL import ImageFile

from experiments import catalog
from experiments import errors
from experiments.data import datasets
from experiments.data import pipeline as input_pipeline
from experiments.data import photo_datasets

COLOURS = {"dog": (200, 30, 30), "horse": (20, 180, 90)}
GREY = (90, 90, 90)  # Other classes'.


PACS_DOMAINS = catalog.FOLDER_DATASETS["PACS"][1]


def write_folder_dataset(
    root, domains=PACS_DOMAINS, classes=("dog", "horse")
):
  """Writes 3 small flat-colour JPEGs per class and domain under root/PACS
  (`COLOURS`' colour, else `GREY`)."""
  for d in domains:
    for c in classes:
      folder = root / "PACS" / d / c
      folder.mkdir(parents=True)
      for k in range(3):
        Image.new("RGB", (20 + k, 30), COLOURS.get(c, GREY)).save(
            folder / f"{k}.jpg")


def test_folder_dataset_reads_domains_classes_and_normalises(tmp_path):
  write_folder_dataset(tmp_path)
  ds = datasets.get_dataset("PACS", data_dir=tmp_path)
  assert ds.name == "PACS"
  assert ds.domain_names == PACS_DOMAINS
  assert ds.num_classes == 2
  assert ds.input_shape == (224, 224, 3)
  for source in ds.domains:
    assert isinstance(source, photo_datasets.FolderSource)
    assert len(source) == 6
    np.testing.assert_array_equal(source.labels, [0, 0, 0, 1, 1, 1])
    for k in range(len(source)):
      element = source[k]
      class_name = ("dog", "horse")[element["label"]]
      assert source.paths[k].parent.name == class_name
      assert element["image"].shape == (224, 224, 3)
      assert element["image"].dtype == np.float32
      expected = np.array(COLOURS[class_name]) / 255 - (0.485, 0.456, 0.406)
      expected /= (0.229, 0.224, 0.225)
      # JPEG may shift a flat colour by a couple of levels.
      np.testing.assert_allclose(
          element["image"], np.broadcast_to(expected, (224, 224, 3)),
          atol=0.05,
      )


def test_photos_read_as_stored_and_resized_on_reading(tmp_path):
  write_folder_dataset(tmp_path)
  ds = datasets.get_dataset("PACS", data_dir=tmp_path)
  decoded = datasets.decoded_photos(ds)
  small = datasets.resized(ds, 16)
  assert small.input_shape == (16, 16, 3) and ds.input_shape == (224, 224, 3)
  for d, source in enumerate(ds.domains):
    for k in range(len(source)):
      # As stored: the file's own size (20 + k % 3 wide), uint8 RGB.
      stored = decoded.domains[d][k]
      assert stored["image"].dtype == np.uint8
      assert stored["image"].shape == (30, 20 + k % 3, 3)
      assert stored["label"] == source.labels[k]
      with Image.open(source.paths[k]) as image:
        np.testing.assert_array_equal(stored["image"],
                                      np.asarray(image.convert("RGB")))
      # Read at 16x16: the stored photo resized bilinearly, normalised.
      resized = np.asarray(Image.fromarray(stored["image"]).resize(
          (16, 16), Image.Resampling.BILINEAR), np.float64)
      expected = (resized / 255 - (0.485, 0.456, 0.406)) / (0.229, 0.224,
                                                             0.225)
      np.testing.assert_allclose(small.domains[d][k]["image"], expected,
                                 atol=1e-6)
      assert source[k]["image"].shape == (224, 224, 3)  # Not resized.


def truncate_photo(path):
  """Replaces ``path`` with a noisy 64x64 JPEG cut short at half, past its
  header: a copy interrupted midway."""
  pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)
  Image.fromarray(pixels).save(path)
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])


def test_a_file_damaged_after_the_check_is_named_when_read(tmp_path):
  write_folder_dataset(tmp_path)
  source = datasets.get_dataset("PACS", data_dir=tmp_path).domains[2]
  damaged = tmp_path / "PACS" / "photo" / "horse" / "1.jpg"
  damaged.write_bytes(np.random.default_rng(0).bytes(300))
  with pytest.raises(datasets.UnreadableImageError,
                     match=re.escape(f"Cannot read image {damaged}")) as e:
    source[source.paths.index(damaged)]
  # Not a usage error, which the training loop raises none of: the train
  # command prints it alone, with exit status 2 (test_train_photos.py).
  assert not isinstance(e.value, errors.UsageError)
  assert "Restore the file" in str(e.value)
  assert "`python -m experiments.data.check` decodes" in str(e.value)


def test_truncated_images_load_as_domainbed_loads_them(tmp_path, monkeypatch):
  write_folder_dataset(tmp_path)
  truncated = tmp_path / "PACS" / "cartoon" / "dog" / "2.jpg"
  truncate_photo(truncated)
  source = datasets.get_dataset("PACS", data_dir=tmp_path).domains[1]
  image = source[source.paths.index(truncated)]["image"]
  assert image.shape == (224, 224, 3) and np.isfinite(image).all()
  # The file is truly cut short: Pillow's default refuses it.
  monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)
  with pytest.raises(datasets.UnreadableImageError, match="is truncated"):
    source.read(source.paths.index(truncated))


def test_truncated_images_load_in_the_worker_processes(tmp_path):
  # Grain's workers are processes of their own: the setting must reach
  # them. Every image is truncated, so every batch reads some.
  write_folder_dataset(tmp_path)
  for path in (tmp_path / "PACS").rglob("*.jpg"):
    truncate_photo(path)
  dataset = datasets.resized(datasets.get_dataset("PACS", data_dir=tmp_path),
                             8)
  splits = input_pipeline.split_domains(dataset, seed=0)
  iterator = input_pipeline.make_train_iterator(
      dataset, [0, 1], splits, batch_size=4, seed=0, num_workers=1)
  try:
    batch = next(iterator)
  finally:
    iterator.close()
  assert batch["image"].shape == (2, 4, 8, 8, 3)


def test_folder_problems_are_one_usage_error_listing_them_all(tmp_path):
  write_folder_dataset(tmp_path, domains=("art_painting", "photo", "sketch"))
  root = tmp_path / "PACS"
  (root / "extra").mkdir()
  (root / "photo" / "cat").mkdir()  # An empty class folder.
  (root / "sketch" / "horse" / "notes.txt").write_text("not an image")
  garbage = root / "art_painting" / "dog" / "1.jpg"
  garbage.write_bytes(b"not a JPEG at all")
  with pytest.raises(datasets.DatasetProblemsError) as e:
    datasets.get_dataset("PACS", data_dir=tmp_path)
  assert isinstance(e.value, errors.UsageError)
  message = str(e.value)
  assert message.startswith(f"PACS in {root} has 5 problems")
  for problem in [f"domain folder missing: {root / 'cartoon'}",
                  f"unexpected folder, not a domain: {root / 'extra'}",
                  f"class folder {root / 'photo' / 'cat'} has no images",
                  f"not an image (by its extension): "
                  f"{root / 'sketch' / 'horse' / 'notes.txt'}",
                  f"not an image: {garbage}"]:
    assert f"  - {problem}" in message, problem
  assert "python -m experiments.data.check --dataset PACS" in message


def test_hidden_and_system_entries_are_ignored(tmp_path):
  write_folder_dataset(tmp_path)
  root = tmp_path / "PACS"
  for folder in (root / "__MACOSX" / "photo", root / ".cache",
                 root / "photo" / "__MACOSX", root / "photo" / "dog" / ".x"):
    folder.mkdir(parents=True)
    (folder / "._0.jpg").write_bytes(b"AppleDouble, not a JPEG")
  (root / "photo" / "dog" / ".DS_Store").write_bytes(b"Finder")
  # Files beside the domain folders, as OfficeHome's ImageInfo.csv.
  (root / "ImageInfo.csv").write_text("image,label")
  ds = datasets.get_dataset("PACS", data_dir=tmp_path)
  assert ds.domain_names == PACS_DOMAINS
  assert [len(source) for source in ds.domains] == [6, 6, 6, 6]


def test_a_missing_domain_is_refused_not_shifted(tmp_path):
  # Without cartoon, the sorted folders would make photo env1.
  write_folder_dataset(tmp_path, domains=("art_painting", "photo", "sketch"))
  with pytest.raises(datasets.DatasetProblemsError,
                     match="has 1 problem;(.|\n)*missing: .*cartoon"):
    datasets.get_dataset("PACS", data_dir=tmp_path)


def test_folder_dataset_class_missing_from_a_domain(tmp_path):
  write_folder_dataset(tmp_path, domains=PACS_DOMAINS[:3])
  write_folder_dataset(tmp_path, domains=PACS_DOMAINS[3:], classes=("dog",))
  with pytest.raises(datasets.DatasetProblemsError,
                     match="sketch has no class folder 'horse'"):
    datasets.get_dataset("PACS", data_dir=tmp_path)


def test_folder_fingerprint_is_of_relative_names_and_sizes(tmp_path):
  write_folder_dataset(tmp_path / "a")
  recorded = datasets.fingerprint(datasets.get_dataset(
      "PACS", data_dir=tmp_path / "a"))
  assert recorded["dataset"] == "PACS"
  assert list(recorded["domains"]) == list(PACS_DOMAINS)
  dog = recorded["domains"]["photo"]["dog"]
  sizes = [p.stat().st_size for p in
           sorted((tmp_path / "a" / "PACS" / "photo" / "dog").iterdir())]
  assert (dog["files"], dog["bytes"]) == (3, sum(sizes))
  # Moved elsewhere, the same data.
  (tmp_path / "a").rename(tmp_path / "b")
  assert datasets.fingerprint(datasets.get_dataset(
      "PACS", data_dir=tmp_path / "b")) == recorded
  horse = tmp_path / "b" / "PACS" / "art_painting" / "horse"
  (horse / "0.jpg").rename(horse / "9.jpg")
  renamed = datasets.fingerprint(datasets.get_dataset(
      "PACS", data_dir=tmp_path / "b"))
  assert renamed["domains"]["art_painting"]["horse"] != (
      recorded["domains"]["art_painting"]["horse"])
  assert {**renamed["domains"], "art_painting": None} == {
      **recorded["domains"], "art_painting": None}


@pytest.mark.parametrize(
    "name, dir_name",
    [("PACS", "PACS"), ("VLCS", "VLCS"), ("OfficeHome", "office_home"),
     ("TerraIncognita", "terra_incognita")],
)
def test_missing_folder_dataset_raises_dataset_not_found(
    tmp_path, name, dir_name
):
  with pytest.raises(
      datasets.DatasetNotFoundError, match=re.escape(str(tmp_path / dir_name))
  ):
    datasets.get_dataset(name, data_dir=tmp_path)


def _torchvision_files(domain_folder):
  """The image files torchvision's ``ImageFolder`` finds in a domain folder,
  relative to it: ``make_dataset`` walks each class folder with
  ``os.walk(followlinks=True)`` and keeps the files by their extension."""
  found = []
  for class_folder in sorted(p for p in domain_folder.iterdir() if p.is_dir()):
    for parent, _, names in os.walk(class_folder, followlinks=True):
      found += [os.path.relpath(os.path.join(parent, n), domain_folder)
                for n in names
                if os.path.splitext(n)[1].lower()
                in photo_datasets.IMAGE_EXTENSIONS]
  return sorted(found)


def test_symlinked_folders_in_a_class_are_read_as_imagefolder_reads_them(
    tmp_path):
  write_folder_dataset(tmp_path)
  elsewhere = tmp_path / "more dogs" / "nested"
  elsewhere.mkdir(parents=True)
  for k in range(4):
    Image.new("RGB", (8, 8), COLOURS["dog"]).save(elsewhere / f"{k}.png")
  domain = tmp_path / "PACS" / "photo"
  (domain / "dog" / "extra").symlink_to(tmp_path / "more dogs")
  # A symlinked image file is read too.
  (domain / "horse" / "linked.jpg").symlink_to(domain / "horse" / "0.jpg")
  source = datasets.get_dataset("PACS", data_dir=tmp_path).domains[2]
  assert sorted(source.files) == _torchvision_files(domain)
  assert len(source) == 6 + 4 + 1
  labels = dict(zip(source.files, source.labels.tolist()))
  assert labels["dog/extra/nested/3.png"] == 0
  assert labels["horse/linked.jpg"] == 1


def test_a_symlink_loop_is_refused_naming_it(tmp_path):
  write_folder_dataset(tmp_path)
  # To the class folder itself, and to the domain folder above it.
  dog = tmp_path / "PACS" / "sketch" / "dog"
  (dog / "sub").mkdir()
  (dog / "sub" / "back").symlink_to(dog)
  horse = tmp_path / "PACS" / "photo" / "horse"
  (horse / "up").symlink_to("..")
  with pytest.raises(datasets.DatasetProblemsError) as e:
    datasets.get_dataset("PACS", data_dir=tmp_path)
  assert str(e.value).startswith(
      f"PACS in {tmp_path / 'PACS'} has 2 problems")
  for link, target in ((dog / "sub" / "back", dog),
                       (horse / "up", horse.parent)):
    assert (f"  - symlink loop: {link} leads back to "
            f"{os.path.realpath(target)}, a folder above it\n") in str(e.value)


def test_a_dangling_symlink_is_a_problem_not_a_traceback(tmp_path):
  write_folder_dataset(tmp_path)
  gone = tmp_path / "PACS" / "cartoon" / "horse" / "gone.jpg"
  gone.symlink_to(tmp_path / "nowhere.jpg")
  beside = tmp_path / "PACS" / "cartoon" / "gone"
  beside.symlink_to(tmp_path / "no folder")
  with pytest.raises(datasets.DatasetProblemsError) as e:
    datasets.get_dataset("PACS", data_dir=tmp_path)
  for link, target in ((beside, tmp_path / "no folder"),
                       (gone, tmp_path / "nowhere.jpg")):
    assert (f"  - broken symlink: {link} -> {target} (No such file or "
            "directory)") in str(e.value)


def test_windows_system_files_are_ignored_as_hidden_ones(tmp_path):
  write_folder_dataset(tmp_path)
  root = tmp_path / "PACS"
  (root / "photo" / "dog" / "Thumbs.db").write_bytes(b"thumbnails")
  (root / "photo" / "desktop.ini").write_text("[.ShellClassInfo]")
  (root / "sketch" / "horse" / "thumbs.db").write_bytes(b"thumbnails")
  ds = datasets.get_dataset("PACS", data_dir=tmp_path)
  assert [len(source) for source in ds.domains] == [6, 6, 6, 6]


def test_a_file_beside_the_class_folders_is_a_problem_saying_so(tmp_path):
  # ImageFolder reads the class folders only: the image would be dropped.
  write_folder_dataset(tmp_path)
  stray = tmp_path / "PACS" / "photo" / "stray.jpg"
  Image.new("RGB", (8, 8)).save(stray)
  with pytest.raises(datasets.DatasetProblemsError) as e:
    datasets.get_dataset("PACS", data_dir=tmp_path)
  assert ("  - a file beside the class folders, which ImageFolder does not "
          f"read: {stray}\n") in str(e.value)


def test_16_bit_grayscale_pngs_load_clipped_as_domainbed(tmp_path):
  write_folder_dataset(tmp_path)
  deep = tmp_path / "PACS" / "art_painting" / "dog" / "deep.png"
  values = np.array([[0, 100, 255, 256, 4000, 65535]], np.uint16)
  Image.fromarray(values).save(deep)
  source = datasets.get_dataset("PACS", data_dir=tmp_path).domains[0]
  stored = source.decoded(source.paths.index(deep))["image"]
  # DomainBed's loader: convert("RGB"), which clips each value to 255.
  expected = np.repeat(np.minimum(values.astype(np.int64), 255)[..., None],
                       3, axis=-1)
  np.testing.assert_array_equal(stored, expected)


def test_data_dir_naming_the_dataset_folder_itself_hints_its_parent(
    tmp_path):
  write_folder_dataset(tmp_path)
  with pytest.raises(datasets.DatasetNotFoundError) as e:
    datasets.get_dataset("PACS", data_dir=tmp_path / "PACS")
  assert (f"{tmp_path / 'PACS'} is PACS's folder itself: give the folder "
          f"that holds PACS, --data_dir {tmp_path}.") in str(e.value)
