"""Featurizer weights that runs start from (``--pretrained``).

* `torch_pickle`: reads PyTorch's ``.pth`` files without PyTorch (NumPy
  alone);
* `imagenet`: torchvision's ImageNet weights, fetched once into a cache and
  checked on every use;
* `convert`: converts torchvision's names and layouts to the featurizers of
  `experiments.models`, checks weights against ``--model`` and loads them.

The command line, ``python -m experiments.weights``, fetches ImageNet
weights ahead of a sweep (``fetch MODEL``) and converts a ``.pth`` file to
``.npz`` (``convert --in IN --out OUT``).
"""
