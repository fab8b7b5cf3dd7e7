"""The datasets and how training reads them.

`datasets` says what a dataset is and builds one by name, from the builders
of `digit_datasets`, `photo_datasets` (with `tfds_sources`) and `wilds`;
`pipeline` feeds its batches through Grain, augmented by
`photo_augmentation` or `wilds_augmentation` (which share `color_jitter`);
`tasks` scores a dataset's task, classification or regression; `check` is
the command that checks a dataset as training does.
"""
