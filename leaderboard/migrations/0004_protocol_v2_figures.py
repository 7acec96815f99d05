# Protocol v2 (issues 13 and 14): intervals, tokens per step, engine AL, host load,
# self-checks per cell; drift per run. Older rows keep nulls (pages show "—").
from django.db import migrations, models


def _float(name):
    return migrations.AddField(model_name="result", name=name,
                               field=models.FloatField(null=True, blank=True))


class Migration(migrations.Migration):

    dependencies = [
        ("leaderboard", "0003_result_analysis"),
    ]

    operations = [
        migrations.AddField(model_name="run", name="drift",
                            field=models.FloatField(null=True, blank=True)),
        migrations.AddField(model_name="run", name="drift_flagged",
                            field=models.BooleanField(default=False)),
        _float("speedup_low"),
        _float("speedup_high"),
        migrations.AddField(model_name="result", name="repetitions",
                            field=models.PositiveIntegerField(null=True, blank=True)),
        migrations.AddField(model_name="result", name="decode_tokens",
                            field=models.PositiveIntegerField(null=True, blank=True)),
        migrations.AddField(model_name="result", name="decode_steps",
                            field=models.PositiveIntegerField(null=True, blank=True)),
        _float("engine_acceptance_length"),
        _float("output_throughput_low"),
        _float("output_throughput_high"),
        _float("acceptance_length_low"),
        _float("acceptance_length_high"),
        migrations.AddField(model_name="result", name="pass_throughputs",
                            field=models.JSONField(null=True, blank=True)),
        _float("host_load"),
        migrations.AddField(model_name="result", name="loaded",
                            field=models.BooleanField(null=True, blank=True)),
        migrations.AddField(model_name="result", name="checks",
                            field=models.JSONField(null=True, blank=True)),
    ]
