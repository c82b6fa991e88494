"""The `kvstore` command line and deployment assets."""
