rule histogram:
    """Particle counts on the voxel grid, one channel per snapshot redshift, for one batch."""
    input:
        str(RUN.batch_summary("simulate", "{batch}")),
    output:
        str(RUN.batch_summary("histogram", "{batch}")),
    params:
        preprocessing=[config["preprocessing"][k] for k in ("grid", "assignment", "dtype")],
    log:
        str(RUN.log("histogram", "{batch}")),
    benchmark:
        str(RUN.benchmark("histogram", "{batch}"))
    shell:
        f"cosmoflow histogram --config {RUN_CONFIG} --batch {{wildcards.batch}} > {{log}} 2>&1"


rule write_tfrecords:
    """Sub-volumes of one shard of one split as TFRecord files (simulations interleaved)."""
    input:
        str(RUN.params_csv),
        batch_outputs("histogram"),
    output:
        str(RUN.tfrecords / "{split}" / "{split}_shard_{shard}.json"),  # manifest.shard_summary_path
    params:
        seed=config["seed"],
        preprocessing=config["preprocessing"],
    log:
        str(RUN.log("write_tfrecords", "{split}_{shard}")),
    benchmark:
        str(RUN.benchmark("write_tfrecords", "{split}_{shard}"))
    shell:
        f"cosmoflow write-tfrecords --config {RUN_CONFIG} --split {{wildcards.split}} "
        f"--shard {{wildcards.shard}} > {{log}} 2>&1"


rule manifest:
    """Merge the shard summaries: files, counts, sha256, shapes, normalisation statistics."""
    input:
        [str(path) for path in shard_summaries(config)],
    output:
        str(RUN.manifest),
    params:
        ranges=target_ranges(config["sampling"]),
    log:
        str(RUN.log("manifest")),
    benchmark:
        str(RUN.benchmark("manifest"))
    shell:
        f"cosmoflow manifest --config {RUN_CONFIG} > {{log}} 2>&1"
