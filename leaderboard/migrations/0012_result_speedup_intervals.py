from django.db import migrations, models


class Migration(migrations.Migration):
    """The speedup's two intervals (Result: speedup_low/high rank; the interval across
    prompts beside it) and what the ranking one is built from. Existing rows keep their
    bounds (the interval across prompts) until they are divided again
    (`manage.py calibrate_protocol` re-divides a protocol's cells)."""

    dependencies = [("leaderboard", "0011_protocolcalibration")]

    operations = [
        migrations.AddField("result", "speedup_prompts_low",
                            models.FloatField(blank=True, null=True)),
        migrations.AddField("result", "speedup_prompts_high",
                            models.FloatField(blank=True, null=True)),
        migrations.AddField("result", "speedup_passes_se",
                            models.FloatField(blank=True, null=True)),
        migrations.AddField("result", "speedup_between_run_variance",
                            models.FloatField(blank=True, null=True)),
    ]
