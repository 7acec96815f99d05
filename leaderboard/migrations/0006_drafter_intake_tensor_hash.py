# Drafter.intake (the published format and what intake did to it), and content_sha256
# recomputed over tensors and config (worker.checkpoint.checkpoint_content_sha256) for
# every stored drafter whose files are at hand, so that duplicates and rejections are
# recognised by the new rule. A drafter whose files are missing keeps its old hash.
import json

from django.core.files.storage import default_storage
from django.db import migrations, models


def rehash(apps, schema_editor):
    from worker.checkpoint import checkpoint_content_sha256

    Drafter = apps.get_model("leaderboard", "Drafter")
    for drafter in Drafter.objects.filter(files__isnull=False).distinct():
        files = list(drafter.files.all())
        try:
            paths = {f.name: default_storage.path(f.file.name) for f in files}
            config = None
            if "config.json" in paths:
                with open(paths["config.json"], "rb") as fh:
                    config = json.loads(fh.read())
            digest = checkpoint_content_sha256(
                sorted(p for n, p in paths.items() if n.endswith(".safetensors")), config)
        except (OSError, ValueError, NotImplementedError):
            continue
        Drafter.objects.filter(pk=drafter.pk).update(content_sha256=digest)


class Migration(migrations.Migration):

    dependencies = [
        ("leaderboard", "0005_protocol_spec_json"),
    ]

    operations = [
        migrations.AddField(model_name="drafter", name="intake",
                            field=models.JSONField(blank=True, default=dict)),
        migrations.AlterField(
            model_name="drafter", name="content_sha256",
            field=models.CharField(blank=True, db_index=True, max_length=64, help_text=(
                "hash of the tensors and config (worker.checkpoint content_sha256), or of "
                "the method and params for a drafter without files"))),
        migrations.RunPython(rehash, migrations.RunPython.noop),
    ]
