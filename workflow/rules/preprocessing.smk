rule histogram:
    """Particle counts on the voxel grid, one channel per snapshot redshift, for one batch."""
    input:
        str(RUN.batch_summary("simulate", "{batch}")),
    output:
        stage_outputs("histogram", batch="{batch}"),
    params:
        **stage_params("histogram"),
    log:
        str(RUN.log("histogram", "{batch}")),
    benchmark:
        str(RUN.benchmark("histogram", "{batch}"))
    shell:
        stage_command("histogram", " --batch {wildcards.batch}")


rule write_tfrecords:
    """Sub-volumes of one shard of one split as TFRecord files (simulations interleaved)."""
    input:
        str(RUN.params_csv),
        lambda wildcards: batch_summaries("histogram", SHARD_BATCHES[wildcards.split, int(wildcards.shard)]),
    output:
        stage_outputs("write_tfrecords", split="{split}", shard="{shard}"),
    params:
        **stage_params("write_tfrecords"),
    log:
        str(RUN.log("write_tfrecords", "{split}_{shard}")),
    benchmark:
        str(RUN.benchmark("write_tfrecords", "{split}_{shard}"))
    shell:
        stage_command("write_tfrecords", " --split {wildcards.split} --shard {wildcards.shard}")


rule manifest:
    """Merge the shard summaries: files, counts, sha256, shapes, normalisation statistics."""
    input:
        SHARD_SUMMARIES,
    output:
        stage_outputs("manifest"),
    params:
        **stage_params("manifest"),
    log:
        str(RUN.log("manifest")),
    benchmark:
        str(RUN.benchmark("manifest"))
    shell:
        stage_command("manifest")
