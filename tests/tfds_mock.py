"""Offline TFDS for the data tests: ``tfds.testing.mock_data`` with examples generated from
each builder's features, and seqio's split-size lookup (which the mock cannot answer, and
which seqio uses only to decide on in-memory caching) switched off; the mock's files are one
shard, so seqio shards a split over hosts by example."""

import contextlib
from unittest import mock

import seqio
import tensorflow_datasets as tfds


@contextlib.contextmanager
def mock_tfds(num_examples, as_dataset_fn=None):
  with tfds.testing.mock_data(num_examples=num_examples, as_dataset_fn=as_dataset_fn,
                              policy=tfds.testing.MockPolicy.USE_CODE), \
       mock.patch.object(seqio.TfdsDataSource, "num_input_examples", return_value=None), \
       mock.patch.object(seqio.TfdsDataSource, "list_shards", return_value=["mock"]):
    yield
