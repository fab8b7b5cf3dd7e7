"""An independent float64 NumPy implementation of PGrad, for the tests.

It works on the flattened parameter vector and forms the d x d covariance
directly, so agreeing with it checks both the rollout and the Gram-matrix
bijection of the library.
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
