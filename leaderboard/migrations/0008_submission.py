"""RefusedSubmission becomes Submission: every attempt, checked by the intake worker. The
rows kept so far were refusals, so they get the state "refused"."""
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leaderboard', '0007_refused_submission'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RenameModel('RefusedSubmission', 'Submission'),
        migrations.AlterField(
            model_name='submission', name='owner',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='submissions', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddField(
            model_name='submission', name='state',
            field=models.CharField(choices=[('checking', 'checking'), ('accepted', 'accepted'), ('refused', 'refused'), ('failed', 'failed')], db_index=True, default='refused', max_length=10),
        ),
        migrations.AlterField(
            model_name='submission', name='state',
            field=models.CharField(choices=[('checking', 'checking'), ('accepted', 'accepted'), ('refused', 'refused'), ('failed', 'failed')], db_index=True, default='checking', max_length=10),
        ),
        migrations.AddField(
            model_name='submission', name='params',
            field=models.JSONField(blank=True, default=dict, help_text='checked method parameters'),
        ),
        migrations.AddField(
            model_name='submission', name='details',
            field=models.JSONField(blank=True, default=dict, help_text='description, link, licence and claims, as submitted'),
        ),
        migrations.AddField(
            model_name='submission', name='hub_reference',
            field=models.CharField(blank=True, help_text='owner/name@revision, for a hub submission', max_length=300),
        ),
        migrations.AddField(
            model_name='submission', name='staged',
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AlterField(
            model_name='submission', name='problems',
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name='submission', name='drafter',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='submissions', to='leaderboard.drafter'),
        ),
        migrations.AddField(
            model_name='submission', name='attempts',
            field=models.PositiveIntegerField(default=0, help_text='checks started (a worker that died mid-check is replaced)'),
        ),
        migrations.AddField(
            model_name='submission', name='finished_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
