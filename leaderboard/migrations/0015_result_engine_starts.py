from django.db import migrations, models


class Migration(migrations.Migration):
    """Protocol v4: the engine starts a cell's passes came from (ProtocolSpec.engine_starts)."""

    dependencies = [("leaderboard", "0014_protocolcalibration_inherited_from")]

    operations = [
        migrations.AddField(
            model_name="result",
            name="engine_starts",
            field=models.PositiveSmallIntegerField(blank=True, null=True),
        ),
    ]
