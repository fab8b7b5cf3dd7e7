"""Independent float64 NumPy implementations, for the tests.

PGrad works on the flattened parameter vector and forms the d x d covariance
directly, so agreeing with it checks both the rollout and the Gram-matrix
bijection of the library. DomainBed's algorithms (second part) follow its
PyTorch code line by line on models small enough for central differences.
"""

import numpy as np


N_IN, N_OUT = 3, 2


def linear_problem(num_domains=3, batch=6, seed=0):
  """Params ``{"w", "b"}`` of a linear model and batches ``{"x", "y"}`` with
  leaves ``(num_domains, batch, ...)``, as float64 NumPy arrays."""
  rng = np.random.default_rng(seed)
  params = {"w": rng.normal(size=(N_IN, N_OUT)), "b": rng.normal(size=N_OUT)}
  # Each domain has its own target map, so the domains pull apart.
  x = rng.normal(size=(num_domains, batch, N_IN))
  maps = rng.normal(size=(num_domains, N_IN, N_OUT))
  y = np.einsum("nbi,nio->nbo", x, maps) + 0.1 * rng.normal(
      size=(num_domains, batch, N_OUT))
  return params, {"x": x, "y": y}


# The options of principal_gradient below that the tests try, each against
# the defaults; k defaults to 2 there.
OPTION_CASES = [
    dict(),
    dict(weighting="l1"),
    dict(weighting="raw"),
    dict(calibrate_length=False),
    dict(components="bottom"),
    dict(reference="mean"),
    dict(k=100),
]


def fixed_schedule(num_domains, num_chunks):
  """The (domain, chunk) steps of ``order="fixed"``."""
  return [(d, c) for c in range(num_chunks) for d in range(num_domains)]


def linear_loss_grad(theta, x, y, n_in, n_out):
  """Mean squared error of a linear model and its gradient, by hand."""
  # ravel_pytree orders a dict's leaves by key: "b" before "w".
  b, w = theta[:n_out], theta[n_out:].reshape(n_in, n_out)
  err = x @ w + b - y
  scale = 2.0 / err.size
  grad = np.concatenate([scale * err.sum(0), (scale * x.T @ err).ravel()])
  return np.mean(err**2), grad


class Adam:
  """Adam as optax.adam defines it (bias-corrected, eps outside the sqrt)."""

  def __init__(self, lr, d, b1=0.9, b2=0.999, eps=1e-8):
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.mu, self.nu, self.count = np.zeros(d), np.zeros(d), 0

  def step(self, grad):
    self.count += 1
    self.mu = self.b1 * self.mu + (1 - self.b1) * grad
    self.nu = self.b2 * self.nu + (1 - self.b2) * grad**2
    mu_hat = self.mu / (1 - self.b1**self.count)
    nu_hat = self.nu / (1 - self.b2**self.count)
    return -self.lr * mu_hat / (np.sqrt(nu_hat) + self.eps)


def trajectory(theta0, xs, ys, schedule, num_chunks, adam, n_in, n_out,
               parallel=False):
  """Points theta_0..theta_{nB}, visiting (domain, chunk) as scheduled."""
  per_chunk = xs.shape[1] // num_chunks
  points, losses, theta = [theta0], [], theta0
  for domain, chunk in schedule:
    rows = slice(chunk * per_chunk, (chunk + 1) * per_chunk)
    start = theta0 if parallel else theta
    loss, grad = linear_loss_grad(start, xs[domain, rows], ys[domain, rows],
                                  n_in, n_out)
    theta = start + adam.step(grad)
    points.append(theta)
    losses.append(loss)
  return np.stack(points), np.array(losses)


def principal_gradient(points, k, weighting="l2", calibrate_length=True,
                       components="top", reference="end", rtol=1e-9):
  """Steps 3-6 of PGrad with the d x d covariance of the centred points."""
  centred = points - points.mean(0)
  lam, vecs = np.linalg.eigh(centred.T @ centred)  # d x d
  lam, vecs = lam[::-1], vecs[:, ::-1]
  keep = lam > rtol * lam[0]
  lam, vecs = lam[keep], vecs[:, keep]
  if components == "top":
    lam, vecs = lam[:k], vecs[:, :k]
  else:
    lam, vecs = lam[-k:], vecs[:, -k:]
  if reference == "end":
    r = points[0] - points[-1]
  else:
    r = points[0] - points[1:].mean(0)
  vecs = vecs * np.where(vecs.T @ r >= 0, 1.0, -1.0)
  norm = {"l2": np.linalg.norm(lam), "l1": lam.sum(), "raw": 1.0}[weighting]
  direction = vecs @ (lam / norm)
  return direction * np.linalg.norm(r) if calibrate_length else direction


# ----------------------------------------------------------------------------
# DomainBed's algorithms (facebookresearch/DomainBed at b93c22a1), float64,
# on small models whose parameters are lists of arrays. Gradients that are
# not written out by hand are central differences, independent of autodiff.


def softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def cross_entropy(logits, labels):
  """Mean cross-entropy of integer ``labels``."""
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return -log_probs[np.arange(len(labels)), labels].mean()


def linear_head_loss_grad(theta, images, labels, num_classes):
  """Mean cross-entropy of a linear head on the pixels, and its gradient.

  ``theta`` is ``[kernel (F, C), bias (C,)]``; returns ``(loss, [d kernel,
  d bias])``.
  """
  kernel, bias = theta
  features = np.asarray(images, np.float64).reshape(len(labels), -1)
  logits = features @ kernel + bias
  residual = (softmax(logits) - np.eye(num_classes)[labels]) / len(labels)
  return (cross_entropy(logits, labels),
          [features.T @ residual, residual.sum(0)])


def numerical_grad(fn, arrays, step=1e-6):
  """Central differences of scalar ``fn(arrays)`` w.r.t. every entry.

  Their error, of order ``step**2`` times the third derivative plus ``1e-16
  / step`` times the loss, is about 1e-10 for the O(1) smooth losses here.
  """
  grads = []
  for i, array in enumerate(arrays):
    grad = np.zeros_like(array)
    for index in np.ndindex(array.shape):
      shifted = [a.copy() for a in arrays]
      shifted[i][index] = array[index] + step
      up = fn(shifted)
      shifted[i][index] = array[index] - step
      grad[index] = (up - fn(shifted)) / (2 * step)
    grads.append(grad)
  return grads


class TorchAdam:
  """``torch.optim.Adam(lr, betas=(b1, b2), weight_decay=wd)`` on a list.

  PyTorch adds ``wd * param`` to the gradient before the moments.
  """

  def __init__(self, lr, wd, theta, b1=0.9, b2=0.999):
    self.lr, self.wd, self.b1, self.b2, self.count = lr, wd, b1, b2, 0
    self.mu = [np.zeros_like(t) for t in theta]
    self.nu = [np.zeros_like(t) for t in theta]

  def step(self, theta, grads):
    self.count += 1
    new = []
    for i, (t, g) in enumerate(zip(theta, grads)):
      g = g + self.wd * t
      self.mu[i] = self.b1 * self.mu[i] + (1 - self.b1) * g
      self.nu[i] = self.b2 * self.nu[i] + (1 - self.b2) * g**2
      mu_hat = self.mu[i] / (1 - self.b1**self.count)
      nu_hat = self.nu[i] / (1 - self.b2**self.count)
      new.append(t - self.lr * mu_hat / (np.sqrt(nu_hat) + 1e-8))
    return new


def mmd_penalty(features, gammas=(0.001, 0.01, 0.1, 1, 10, 100, 1000)):
  """``AbstractMMD``'s Gaussian ``mmd`` averaged over pairs of domains."""
  def kernel(x, y):
    distances = ((x**2).sum(1)[:, None] + (y**2).sum(1)[None]
                 - 2 * x @ y.T).clip(min=1e-30)
    return sum(np.exp(-g * distances) for g in gammas)

  features = np.asarray(features, np.float64)
  pairs = [(i, j) for i in range(len(features))
           for j in range(i + 1, len(features))]
  return np.mean([kernel(features[i], features[i]).mean()
                  + kernel(features[j], features[j]).mean()
                  - 2 * kernel(features[i], features[j]).mean()
                  for i, j in pairs])


def group_dro(theta, batch_list, lr, wd, eta, num_classes):
  """``GroupDRO.update`` over several steps; returns ``(theta, q, losses)``."""
  adam = TorchAdam(lr, wd, theta)
  q, losses = None, []
  for batches in batch_list:
    terms = [linear_head_loss_grad(theta, x, y, num_classes)
             for x, y in zip(batches["image"], batches["label"])]
    domain_losses = np.array([loss for loss, _ in terms])
    q = np.ones(len(terms)) if q is None else q
    q = q * np.exp(eta * domain_losses)
    q = q / q.sum()
    grads = [sum(w * grads[k] for w, (_, grads) in zip(q, terms))
             for k in range(len(theta))]
    theta = adam.step(theta, grads)
    losses.append(domain_losses @ q)
  return theta, q, losses


def split_meta_train_test(perm, num_meta_test):
  """DomainBed's ``lib/misc.py`` pairing, given its permutation."""
  meta_train = perm[:len(perm) - num_meta_test]
  meta_test = perm[-num_meta_test:]
  return [(i, meta_test[k % num_meta_test]) for k, i in enumerate(meta_train)]


def random_pairs_of_minibatches(perm):
  """DomainBed's ``lib/misc.py`` pairing, given its permutation."""
  return [(perm[i], perm[(i + 1) % len(perm)]) for i in range(len(perm))]


def mldg(theta, batch_list, pairs_list, lr, wd, beta, num_classes):
  """``MLDG.update`` (first order) over several steps, with given pairs.

  Returns ``(theta, objectives)``.
  """
  adam = TorchAdam(lr, wd, theta)
  objectives = []
  for batches, pairs in zip(batch_list, pairs_list):
    n = len(batches["label"])
    grads = [np.zeros_like(t) for t in theta]
    objective = 0.0
    for i, j in pairs:
      loss_i, grads_i = linear_head_loss_grad(
          theta, batches["image"][i], batches["label"][i], num_classes)
      inner = TorchAdam(lr, wd, theta).step(theta, grads_i)
      loss_j, grads_j = linear_head_loss_grad(
          inner, batches["image"][j], batches["label"][j], num_classes)
      grads = [g + gi / n + beta * gj / n
               for g, gi, gj in zip(grads, grads_i, grads_j)]
      objective += loss_i + beta * loss_j
    theta = adam.step(theta, grads)
    objectives.append(objective / n)
  return theta, objectives


def dann_losses(generator, discriminator, images, labels, grad_penalty,
                conditional=False):
  """``AbstractDANN.update``'s losses for a linear featurizer and head.

  ``generator`` is ``[W_f, b_f, W_h, b_h]``; ``discriminator`` an MLP's
  ``[W_1, b_1, ..., W_L, b_L]`` with ReLUs between, and with
  ``conditional`` (CDANN) the class embeddings ``E (C, F)`` last: the
  discriminator then sees ``features + E[label]`` and its cross-entropy is
  class-balanced, each example weighing ``1 / (its class's count * (largest
  label + 1))`` (``F.one_hot`` without ``num_classes``). The gradient of the
  discriminator's summed (unweighted) cross-entropy w.r.t. its input is
  backpropagated by hand.

  Returns:
    ``(classifier loss, discriminator loss with penalty, penalty)``.
  """
  w_f, b_f, w_h, b_h = generator
  n, b = labels.shape
  labels = labels.reshape(-1)
  x = np.asarray(images, np.float64).reshape(n * b, -1)
  features = x @ w_f + b_f
  nll = cross_entropy(features @ w_h + b_h, labels)
  domains = np.repeat(np.arange(n), b)
  if conditional:
    *discriminator, embeddings = discriminator
    inputs = features + embeddings[labels]
  else:
    inputs = features
  layers = list(zip(discriminator[::2], discriminator[1::2]))
  activations, h = [], inputs
  for k, (w, bias) in enumerate(layers):
    a = h @ w + bias
    activations.append(a)
    h = np.maximum(a, 0) if k < len(layers) - 1 else a
  grad = softmax(h) - np.eye(h.shape[1])[domains]
  for k in range(len(layers) - 1, -1, -1):
    if k < len(layers) - 1:
      grad = grad * (activations[k] > 0)
    grad = grad @ layers[k][0].T
  penalty = (grad**2).sum(1).mean()
  if conditional:
    counts = np.bincount(labels)
    weights = 1.0 / (counts[labels] * len(counts))
    log_probs = np.log(softmax(h))[np.arange(len(domains)), domains]
    disc_loss = -(weights * log_probs).sum()
  else:
    disc_loss = cross_entropy(h, domains)
  return nll, disc_loss + grad_penalty * penalty, penalty


def dann(generator, discriminator, batch_list, hparams, conditional=False):
  """``AbstractDANN.update`` over several steps; returns both networks
  (with ``conditional``, CDANN's: the discriminator's list ends with the
  class embeddings, which its Adam trains)."""
  gen_adam = TorchAdam(hparams["lr_g"], hparams["weight_decay_g"], generator,
                       hparams["beta1"], 0.9)
  disc_adam = TorchAdam(hparams["lr_d"], hparams["weight_decay_d"],
                        discriminator, hparams["beta1"], 0.9)
  d_steps, weight = hparams["d_steps_per_g_step"], hparams["lambda"]
  for count, batches in enumerate(batch_list, start=1):
    losses = lambda gen, disc: dann_losses(
        gen, disc, batches["image"], np.asarray(batches["label"]),
        hparams["grad_penalty"], conditional)
    if count % (1 + d_steps) < d_steps:
      grads = numerical_grad(lambda d: losses(generator, d)[1], discriminator)
      discriminator = disc_adam.step(discriminator, grads)
    else:
      grads = numerical_grad(
          lambda g: (lambda nll, disc_loss, _: nll - weight * disc_loss)(
              *losses(g, discriminator)), generator)
      generator = gen_adam.step(generator, grads)
  return generator, discriminator


def conv_same(x, kernel, bias):
  """A stride-1 convolution padded to keep the size: ``x (N, H, W, I)``,
  ``kernel (K, K, I, O)``."""
  size = kernel.shape[0]
  pad = size // 2
  padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  h, w = x.shape[1:3]
  out = np.zeros(x.shape[:3] + (kernel.shape[-1],))
  for dy in range(size):
    for dx in range(size):
      out += padded[:, dy:dy + h, dx:dx + w] @ kernel[dy, dx]
  return out + bias


def context_maps(context_net, x, running, train):
  """DomainBed's ``ContextNet`` forward; ``context_net`` is ``[(kernel,
  bias, scale, shift) x 2, (kernel, bias)]``, ``running`` the two
  BatchNorms' ``[mean, var]``, updated in train mode as PyTorch's (momentum
  0.1, the running variance of the unbiased batch variance, while the batch
  is normalized with the biased one)."""
  h = np.asarray(x, np.float64)
  for k, (kernel, bias, scale, shift) in enumerate(context_net[:2]):
    h = conv_same(h, kernel, bias)
    if train:
      mean, var = h.mean((0, 1, 2)), h.var((0, 1, 2))
      running[k] = [0.9 * running[k][0] + 0.1 * mean,
                    0.9 * running[k][1] + 0.1 * h.var((0, 1, 2), ddof=1)]
    else:
      mean, var = running[k]
    h = np.maximum((h - mean) / np.sqrt(var + 1e-5) * scale + shift, 0)
  return conv_same(h, *context_net[2])


def arm_contexts(maps, support_size, loader_batch):
  """``ARM.predict``'s contexts over loader batches of ``loader_batch``."""
  contexts = []
  for start in range(0, len(maps), loader_batch):
    batch = maps[start:start + loader_batch]
    size = support_size if len(batch) % support_size == 0 else len(batch)
    for first in range(0, len(batch), size):
      group = batch[first:first + size]
      contexts.append(np.repeat(group.mean(0, keepdims=True), len(group), 0))
  return np.concatenate(contexts)


def arm_logits(theta, context_net, running, images, support_size,
               loader_batch, train):
  """ARM's logits of a linear head on the pixels and the context channel."""
  images = np.asarray(images, np.float64)
  maps = context_maps(context_net, images, running, train)
  inputs = np.concatenate(
      [images, arm_contexts(maps, support_size, loader_batch)], axis=-1)
  return inputs.reshape(len(images), -1) @ theta[0] + theta[1], inputs


def arm(theta, context_net, running, batch_list, lr, wd, num_classes):
  """``ARM``'s ERM updates over several steps: the head alone trains.

  Returns ``(theta, running)``.
  """
  adam = TorchAdam(lr, wd, theta)
  for batches in batch_list:
    n, b = np.shape(batches["label"])
    images = np.asarray(batches["image"]).reshape(
        (n * b,) + np.shape(batches["image"])[2:])
    labels = np.asarray(batches["label"]).reshape(-1)
    _, inputs = arm_logits(theta, context_net, running, images, b, n * b,
                           train=True)
    _, grads = linear_head_loss_grad(theta, inputs, labels, num_classes)
    theta = adam.step(theta, grads)
  return theta, running


# ----------------------------------------------------------------------------
# DomainBed's VREx, IB_ERM, SD, CDANN (`dann` above, conditional) and SagNet
# (facebookresearch/DomainBed at b93c22a1), float64, on a linear featurizer
# ``[W_f, b_f]`` and linear heads: ``theta = [W_f, b_f, W_h, b_h]``.


def linear_features_and_logits(theta, images):
  """``(features, logits)`` of every image, ``(..., F)`` and ``(..., C)``."""
  w_f, b_f, w_h, b_h = theta
  x = np.asarray(images, np.float64)
  lead = x.shape[:2] if x.ndim > 2 else x.shape[:1]
  features = x.reshape(lead + (-1,)) @ w_f + b_f
  return features, features @ w_h + b_h


def vrex_terms(theta, batches):
  """``VREx.update``'s ``(mean risk, penalty, last domain's nll)``: the
  biased variance of the domains' risks."""
  _, logits = linear_features_and_logits(theta, batches["image"])
  risks = np.array([cross_entropy(z, y)
                    for z, y in zip(logits, np.asarray(batches["label"]))])
  return risks.mean(), ((risks - risks.mean()) ** 2).mean(), risks[-1]


def ib_erm_terms(theta, batches):
  """``IB_ERM.update``'s ``(mean risk, penalty)``: every domain's features'
  unbiased variance over the batch, averaged over features, then domains."""
  features, logits = linear_features_and_logits(theta, batches["image"])
  labels = np.asarray(batches["label"])
  nll = np.mean([cross_entropy(z, y) for z, y in zip(logits, labels)])
  penalty = np.mean([f.var(axis=0, ddof=1).mean() for f in features])
  return nll, penalty


def annealed_penalty(theta, batch_list, terms, lr, wd, weight, warmup_weight,
                     anneal):
  """IRM's, VREx's and IB_ERM's update over several steps: the penalty
  weighs ``warmup_weight`` while ``update_count < anneal``, then
  ``weight``; at ``update_count == anneal`` Adam is built afresh before
  its step; the count goes up after it.

  Returns ``(theta, objectives)``.
  """
  adam = TorchAdam(lr, wd, theta)
  objectives = []
  for count, batches in enumerate(batch_list):
    penalty_weight = weight if count >= anneal else warmup_weight

    def objective(theta, batches=batches, penalty_weight=penalty_weight):
      risk, penalty = terms(theta, batches)[:2]
      return risk + penalty_weight * penalty

    objectives.append(objective(theta))
    if count == anneal:
      adam = TorchAdam(lr, wd, theta)
    theta = adam.step(theta, numerical_grad(objective, theta))
  return theta, objectives


def sd(theta, batch_list, lr, wd, sd_reg):
  """``SD.update`` over several steps: the pooled cross-entropy plus
  ``sd_reg`` times the mean squared logit. Returns ``(theta, losses)``."""
  adam = TorchAdam(lr, wd, theta)
  losses = []
  for batches in batch_list:
    labels = np.asarray(batches["label"]).reshape(-1)

    def objective(theta, batches=batches, labels=labels):
      _, logits = linear_features_and_logits(theta, batches["image"])
      logits = logits.reshape(len(labels), -1)
      return cross_entropy(logits, labels) + sd_reg * (logits**2).mean()

    losses.append(objective(theta))
    theta = adam.step(theta, numerical_grad(objective, theta))
  return theta, losses


def sagnet_randomize(features, alpha, perm, what, base=None, eps=1e-5):
  """``SagNet.randomize`` of ``(N, F)`` features. ``base``: the features
  whose normalised, permuted values a content randomisation takes, held
  constant (its ``detach``); by default ``features`` themselves."""
  def moments(x):
    return x.mean(-1, keepdims=True), x.var(-1, ddof=1, keepdims=True)

  mean, var = moments(features)
  if what == "style":
    normalised = (features - mean) / np.sqrt(var + eps)
    mean = alpha * mean + (1 - alpha) * mean[perm]
    var = alpha * var + (1 - alpha) * var[perm]
  else:
    base = features if base is None else base
    base_mean, base_var = moments(base)
    normalised = ((base - base_mean) / np.sqrt(base_var + eps))[perm]
  return normalised * np.sqrt(var + eps) + mean


def sagnet(theta, style, batch_list, draws_list, lr, wd, w_adv):
  """``SagNet.update`` over several steps.

  ``theta`` is ``[W_f, b_f, W_c, b_c]`` (featurizer and content network),
  ``style`` the style network's ``[W_s, b_s]``; every step's draws are
  ``[(alpha, perm)]`` of its content, style and adversary passes. Three
  Adams; the featurizer's steps after the content loss and again after the
  adversary's.

  Returns ``(theta, style, [(loss_c, loss_s, loss_adv)])``.
  """
  adam_f = TorchAdam(lr, wd, theta[:2])
  adam_c = TorchAdam(lr, wd, theta[2:])
  adam_s = TorchAdam(lr, wd, style)
  history = []
  for batches, ((alpha_c, perm_c), (alpha_s, perm_s),
                (alpha_a, perm_a)) in zip(batch_list, draws_list):
    labels = np.asarray(batches["label"]).reshape(-1)
    x = np.asarray(batches["image"], np.float64).reshape(len(labels), -1)
    featurize = lambda f: x @ f[0] + f[1]

    def loss_c(theta):
      inputs = sagnet_randomize(featurize(theta[:2]), alpha_c, perm_c,
                                "style")
      return cross_entropy(inputs @ theta[2] + theta[3], labels)

    losses = [loss_c(theta)]
    grads = numerical_grad(loss_c, theta)
    theta = adam_f.step(theta[:2], grads[:2]) + adam_c.step(theta[2:],
                                                            grads[2:])
    features = featurize(theta[:2])

    def loss_s(style):
      inputs = sagnet_randomize(features, alpha_s, perm_s, "content")
      return cross_entropy(inputs @ style[0] + style[1], labels)

    losses.append(loss_s(style))
    style = adam_s.step(style, numerical_grad(loss_s, style))

    def loss_adv(f):
      inputs = sagnet_randomize(featurize(f), alpha_a, perm_a, "content",
                                base=features)
      logits = inputs @ style[0] + style[1]
      log_probs = logits - logits.max(-1, keepdims=True)
      log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
      return -w_adv * log_probs.mean()

    losses.append(loss_adv(theta[:2]))
    theta = adam_f.step(theta[:2], numerical_grad(loss_adv, theta[:2])) + (
        theta[2:])
    history.append(tuple(losses))
  return theta, style, history


# ----------------------------------------------------------------------------
# DomainBed's ANDMask, SANDMask, IGA, RSC, SelfReg and MTL (algorithms.py at
# b93c22a1), float64, on a linear featurizer and a linear head:
# ``theta = [W_f (P, F), b_f (F,), W_h (F or 2F, C), b_h (C,)]``.


def linear_net(theta, images, labels, num_classes, mask=None,
               embedding=None):
  """Mean cross-entropy of ``head([features * mask, embedding])`` and its
  gradient w.r.t. ``theta``, by hand; ``features = x W_f + b_f``.

  ``mask`` (``(N, F)``, held constant) mutes features, as RSC's;
  ``embedding`` (``(N, E)``, no gradient) is appended to the head's input,
  as MTL's.

  Returns:
    ``(loss, [d W_f, d b_f, d W_h, d b_h], features)``.
  """
  w_f, b_f, w_h, b_h = theta
  labels = np.asarray(labels)
  x = np.asarray(images, np.float64).reshape(len(labels), -1)
  features = x @ w_f + b_f
  kept = features if mask is None else features * mask
  inputs = kept if embedding is None else np.concatenate(
      [kept, embedding], axis=1)
  logits = inputs @ w_h + b_h
  residual = (softmax(logits) - np.eye(num_classes)[labels]) / len(labels)
  d_kept = (residual @ w_h.T)[:, :features.shape[1]]
  d_features = d_kept if mask is None else d_kept * mask
  return (cross_entropy(logits, labels),
          [x.T @ d_features, d_features.sum(0), inputs.T @ residual,
           residual.sum(0)], features)


def and_mask_direction(grads, tau):
  """``ANDMask.mask_grads`` of one tensor's ``(n, ...)`` domain gradients."""
  mask = (np.abs(np.mean(np.sign(grads), axis=0)) >= tau).astype(np.float64)
  return mask * grads.mean(0) * (1.0 / (1e-10 + mask.sum() / mask.size))


def sand_mask_direction(grads, tau, k):
  """``SANDMask.mask_grads`` of one tensor's ``(n, ...)`` domain gradients."""
  with np.errstate(divide="ignore", invalid="ignore"):
    var = grads.var(axis=0, ddof=1)
    var[np.isnan(var)] = 1e-17
    lam = var**-1.0
    mask = np.tanh(k * lam * (np.abs(np.sign(grads).mean(axis=0)) - tau))
    mask = np.maximum(mask, 0)
  mask[np.isnan(mask)] = 1e-17
  return mask * grads.mean(0) * (1.0 / (1e-10 + mask.sum() / mask.size))


def masked_gradients(theta, batch_list, lr, wd, direction, num_classes):
  """``ANDMask.update`` or ``SANDMask.update`` over several steps, with
  ``direction`` the mask of one tensor's domain gradients.

  Returns ``(theta, mean losses)``.
  """
  adam = TorchAdam(lr, wd, theta)
  losses = []
  for batches in batch_list:
    terms = [linear_net(theta, x, y, num_classes)
             for x, y in zip(batches["image"], batches["label"])]
    grads = [direction(np.stack([grads[k] for _, grads, _ in terms]))
             for k in range(len(theta))]
    theta = adam.step(theta, grads)
    losses.append(np.mean([loss for loss, _, _ in terms]))
  return theta, losses


def iga_objective(theta, batches, penalty, num_classes):
  """IGA's objective and penalty: the mean loss plus ``penalty`` times the
  summed squared deviations of the domains' gradients from their mean."""
  terms = [linear_net(theta, x, y, num_classes)
           for x, y in zip(batches["image"], batches["label"])]
  grads = [np.stack([grads[k] for _, grads, _ in terms])
           for k in range(len(theta))]
  deviation = sum(((g - g.mean(0))**2).sum() for g in grads)
  mean_loss = np.mean([loss for loss, _, _ in terms])
  return mean_loss + penalty * deviation, mean_loss, deviation


def iga(theta, batch_list, lr, wd, penalty, num_classes):
  """``IGA.update`` over several steps: the objective's gradient by central
  differences of the hand-written domain gradients.

  DomainBed holds the mean gradient constant (no ``create_graph``); the
  deviations from it sum to zero, so differentiating it too changes
  nothing.

  Returns ``(theta, mean losses, penalties)``.
  """
  adam = TorchAdam(lr, wd, theta)
  losses, penalties = [], []
  for batches in batch_list:
    _, mean_loss, deviation = iga_objective(theta, batches, penalty,
                                            num_classes)
    grads = numerical_grad(
        lambda t: iga_objective(t, batches, penalty, num_classes)[0], theta)
    theta = adam.step(theta, grads)
    losses.append(mean_loss)
    penalties.append(deviation)
  return theta, losses, penalties


def rsc(theta, batch_list, lr, wd, f_drop_factor, b_drop_factor,
        num_classes):
  """``RSC.update`` over several steps, its percentiles NumPy's.

  Returns ``(theta, losses)``.
  """
  adam = TorchAdam(lr, wd, theta)
  losses = []
  for batches in batch_list:
    n, b = np.shape(batches["label"])
    x = np.asarray(batches["image"], np.float64).reshape(n * b, -1)
    y = np.asarray(batches["label"]).reshape(-1)
    w_f, b_f, w_h, b_h = theta
    features = x @ w_f + b_f
    one_hot = np.eye(num_classes)[y]
    # d (sum of true-class logits) / d features: the head's label column.
    grads_f = w_h[:, y].T
    percentiles = np.percentile(grads_f, (1 - f_drop_factor) * 100, axis=1)
    mask_f = grads_f < percentiles[:, None]
    true = lambda logits: (softmax(logits) * one_hot).sum(1)
    changes = (true(features @ w_h + b_h)
               - true((features * mask_f) @ w_h + b_h))
    mask_b = changes < np.percentile(changes, (1 - b_drop_factor) * 100)
    mask = (mask_f | mask_b[:, None]).astype(np.float64)
    loss, grads, _ = linear_net(theta, x, y, num_classes, mask=mask)
    theta = adam.step(theta, grads)
    losses.append(loss)
  return theta, losses


def batch_norm_train(h):
  """BatchNorm1d in train mode at its initial scale 1 and shift 0."""
  return (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)


def selfreg_loss(theta, projection, x, y, draws, scale, num_classes):
  """``SelfReg.update``'s loss on the class-sorted ``x``, ``y`` with its
  draws ``(first, second, lam)`` and ``min(ce, 1)`` given as ``scale``.

  Returns ``(loss, ce)``.
  """
  first, second, lam = draws
  w_f, b_f, w_h, b_h = theta
  features = x @ w_f + b_f
  h = features
  for i, (kernel, bias) in enumerate(projection):
    h = batch_norm_train(h @ kernel + bias)
    h = np.maximum(h, 0) if i < len(projection) - 1 else h
  logits = features @ w_h + b_h
  output_2, feat_2 = logits[first], h[first]
  output_3 = lam * output_2 + (1 - lam) * logits[second]
  feat_3 = lam * feat_2 + (1 - lam) * h[second]
  mse = lambda a, b: np.mean((a - b)**2)
  ce = cross_entropy(logits, y)
  loss = ce + scale * (lam * (mse(logits, output_2)
                              + 0.3 * mse(features, feat_2))
                       + (1 - lam) * (mse(logits, output_3)
                                      + 0.3 * mse(features, feat_3)))
  return loss, ce


def selfreg(theta, projection, batch_list, draws_list, lr, wd, num_classes):
  """``SelfReg.update`` over several steps, given each step's draws
  ``(order, first, second, lam)``: ``order`` sorts the pooled batch by
  class, ``first`` and ``second`` shuffle within the classes. The
  projection (``cdpl``) is not in the optimizer; ``min(ce, 1)`` is a
  constant (``.item()``). Gradients by central differences.

  Returns ``(theta, losses, scales)``, ``scales`` every step's ``min(ce,
  1)``.
  """
  adam = TorchAdam(lr, wd, theta)
  losses, scales = [], []
  for batches, (order, first, second, lam) in zip(batch_list, draws_list):
    n, b = np.shape(batches["label"])
    x = np.asarray(batches["image"], np.float64).reshape(n * b, -1)[order]
    y = np.asarray(batches["label"]).reshape(-1)[order]
    assert np.all(np.diff(y) >= 0)
    assert np.all(y[first] == y) and np.all(y[second] == y)
    draws = (first, second, lam)
    _, ce = selfreg_loss(theta, projection, x, y, draws, 1.0, num_classes)
    scale = min(ce, 1.0)
    loss, _ = selfreg_loss(theta, projection, x, y, draws, scale,
                           num_classes)
    grads = numerical_grad(
        lambda t: selfreg_loss(t, projection, x, y, draws, scale,
                               num_classes)[0], theta)
    theta = adam.step(theta, grads)
    losses.append(loss)
    scales.append(scale)
  return theta, losses, scales


def mtl(theta, batch_list, noise_list, lr, wd, ema, num_classes):
  """``MTL.update`` over several steps, given each step's standard normal
  ``(n, b, F)`` draws, which replace the embeddings (``.normal_()``).

  Returns ``(theta, embeddings, losses)``.
  """
  adam = TorchAdam(lr, wd, theta)
  embeddings, losses = None, []
  for batches, noise in zip(batch_list, noise_list):
    total, grads, means = 0.0, [np.zeros_like(t) for t in theta], []
    for x, y, z in zip(batches["image"], batches["label"], noise):
      loss, domain_grads, features = linear_net(theta, x, y, num_classes,
                                                embedding=z)
      total += loss
      grads = [g + d for g, d in zip(grads, domain_grads)]
      means.append(features.mean(0))
    if embeddings is None:
      embeddings = np.zeros((len(means), len(means[0])))
    embeddings = ema * np.stack(means) + (1 - ema) * embeddings
    theta = adam.step(theta, grads)
    losses.append(total)
  return theta, embeddings, losses
