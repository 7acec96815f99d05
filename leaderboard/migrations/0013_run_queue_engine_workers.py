import django.utils.timezone
from django.db import migrations, models


def queue_is_hardware(apps, schema_editor):
    """Runs queued before engine versions went to their hardware class's queue; so do runs
    of protocols that pin no engine version (worker.protocol.engine_queue)."""
    Run = apps.get_model("leaderboard", "Run")
    Run.objects.filter(queue="").update(queue=models.F("hardware"))


class Migration(migrations.Migration):
    """Run.queue (a run goes to its protocol's (hardware, engine, engine version) queue) and
    EngineWorker (the workers that announced themselves, and the queues they consume)."""

    dependencies = [("leaderboard", "0012_result_speedup_intervals")]

    operations = [
        migrations.AddField(
            model_name="run", name="queue",
            field=models.CharField(db_index=True, default="", max_length=100)),
        migrations.RunPython(queue_is_hardware, migrations.RunPython.noop),
        migrations.CreateModel(
            name="EngineWorker",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name="ID")),
                ("hostname", models.CharField(help_text="celery node name", max_length=200,
                                              unique=True)),
                ("hardware", models.CharField(max_length=50)),
                ("engine", models.CharField(max_length=50)),
                ("engine_version", models.CharField(blank=True, max_length=50)),
                ("queues", models.JSONField(default=list, help_text="the queues it consumes")),
                ("python_version", models.CharField(blank=True, max_length=50)),
                ("torch_version", models.CharField(blank=True, max_length=50)),
                ("started_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("last_seen_at", models.DateTimeField(db_index=True,
                                                      default=django.utils.timezone.now)),
            ],
            options={"ordering": ["hardware", "engine", "engine_version", "hostname"]},
        ),
    ]
