"""Shared fixtures. Service fixtures (real etcd, real S3 server) live in tests/fixtures/ as plugins."""

import os

# Never let a test reach a real cloud: s3fs/botocore fall back to public AWS hosts and instance metadata.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

# tests.must_run: with ELASTICTRAIN_REQUIRE_MUST_RUN=1 (CI) a skipped test fails the session; pytester tests that.
pytest_plugins: list[str] = ["tests.fixtures.etcd", "tests.fixtures.s3", "tests.must_run", "pytester"]
