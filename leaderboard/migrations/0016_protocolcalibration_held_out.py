from django.db import migrations, models


class Migration(migrations.Migration):
    """A calibration's held-out check (worker.calibration.held_out_rows): of the cell pairs
    it came from, how many stay within |z| <= 1.96 when each task's are judged with the
    estimate the other tasks' cells give alone."""

    dependencies = [("leaderboard", "0015_result_engine_starts")]

    operations = [
        migrations.AddField(
            model_name="protocolcalibration",
            name="held_out_pairs",
            field=models.PositiveIntegerField(
                default=0, help_text="cell pairs judged held out by task (0: no check, "
                                     "one task only or recorded before the check)"),
        ),
        migrations.AddField(
            model_name="protocolcalibration",
            name="held_out_within",
            field=models.PositiveIntegerField(
                default=0, help_text="of those, the pairs with |z| <= 1.96"),
        ),
    ]
