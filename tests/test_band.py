"""posenc_jax.kernels.band: the band's entries against its formula, and its scatter-free
gradient against JAX's transpose of the band's gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.kernels.band import band_gradient, bias_band

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
