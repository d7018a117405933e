"""The build side, installed by scripts/setup_env.sh (an editable install of this checkout, with
the console commands of pyproject.toml's [project.scripts]): reading a model's contract
(`contract`, `find_padding`, `weight_bytes`), `compile`, `import_artifact`, `archive` (with
`worker_sizing`, `bare_so`), `inspect_artifact`, `verify_store`, `kserve` (KServe storage layout
and manifests), `client`, `prefork` (TorchServe's workers forked from a warm process), and
`local_server` (a real TorchServe from the shipped configuration).

The tools work on the checkout they live in: `archive` puts the handler package beside this one
(`handlers/`, installed with it) into each .mar, `kserve` reads `kserve/`.
"""
