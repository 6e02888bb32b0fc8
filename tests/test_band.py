"""posenc_jax.kernels.band: the band's entries against its formula, its scatter-free
gradient against JAX's transpose of the band's gather, and the gradient from per-unit sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.kernels.band import band_gradient, bias_band, unit_gradient

SHAPES = [  # (vector length, rows, width, lead): wider and narrower than the vector
    (20, 4, 30, 0), (20, 4, 10, 3), (7, 8, 16, 5), (50, 16, 40, 0), (9, 1, 12, 2)]


@pytest.mark.parametrize("length, rows, width, lead", SHAPES)
def test_band_entries_follow_the_formula(length, rows, width, lead):
  vector = jax.random.normal(jax.random.PRNGKey(0), (2, length))
  band = bias_band(vector, rows, width, lead)
  index = np.arange(width)[None, :] - np.arange(rows)[:, None] + rows - 1 - lead
  on = (index >= 0) & (index < length)
  want = np.where(on, np.asarray(vector)[:, np.clip(index, 0, length - 1)], 0.0)
  assert band.shape == (2, rows, width) and band.dtype == jnp.float32
  np.testing.assert_array_equal(band, want)


@pytest.mark.parametrize("length, rows, width, lead", SHAPES)
def test_band_gradient_is_the_transpose_without_a_scatter(length, rows, width, lead):
  vector = jax.random.normal(jax.random.PRNGKey(0), (2, length))
  dband = jax.random.normal(jax.random.PRNGKey(1), (2, rows, width))
  _, vjp = jax.vjp(lambda x: bias_band(x, rows, width, lead), vector)
  np.testing.assert_allclose(band_gradient(dband, length, lead), vjp(dband)[0], rtol=1e-5,
                             atol=1e-5)
  assert "scatter" not in str(jax.make_jaxpr(band_gradient, static_argnums=(1, 2))(
      dband, length, lead))


def test_unit_gradient_is_the_gradient_through_every_unit_of_the_band():
  """Per-unit cotangents ``[B, H, N, b, b]`` (unit n: band columns n b + [0, b)) give the
  vector's gradient of ``sum_{batch, n} <du[batch, n], band unit n>``."""
  length, rows, units = 40, 8, 5
  vector = jax.random.normal(jax.random.PRNGKey(0), (3, length))
  du = jax.random.normal(jax.random.PRNGKey(1), (2, 3, units, rows, rows))

  def paired(x):
    band = bias_band(x, rows, units * rows)
    return sum(jnp.sum(du[:, :, n] * band[None, :, :, n * rows:(n + 1) * rows])
               for n in range(units))

  np.testing.assert_allclose(unit_gradient(du, length), jax.grad(paired)(vector), rtol=1e-5,
                             atol=1e-5)
