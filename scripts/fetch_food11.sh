#!/usr/bin/env bash
# Fetch the Food-11 image set (the NYU course's data) to a GPU node and lay it out for ImageFolder.
#
#   bash scripts/fetch_food11.sh [DEST]          # DEST defaults to ~/Food-11
#   labkit train --strategy single --model resnet50 --profile a100x1 --data ~/Food-11
#
# Food-11 (EPFL MMSPG; Singla et al. 2016, "Food/Non-food Image Classification and Food
# Categorization using Pre-Trained GoogLeNet Model") has 16,643 photos in 11 classes, split into
# training/ (9,866), validation/ (3,430) and evaluation/ (3,347). The zip names files
# "<class>_<n>.jpg" in flat split folders; this script moves them into class_00 .. class_10
# sub-folders, the layout torchvision.datasets.ImageFolder reads. labkit trains on training/ and
# evaluates on validation/. Needs curl and unzip, ~1.2 GB of disk; run it once per node (or on the
# shared file system). FOOD11_URL overrides the download address (e.g. a local mirror).
set -euo pipefail

DEST="${1:-$HOME/Food-11}"
URL="${FOOD11_URL:-https://nyu.box.com/shared/static/m5kvcl25hfpljul3elhu6xz8y2w61op4.zip}"
CLASSES=("Bread" "Dairy product" "Dessert" "Egg" "Fried food" "Meat" "Noodles/Pasta" "Rice" "Seafood"
         "Soup" "Vegetable/Fruit")

for tool in curl unzip; do
    command -v "$tool" >/dev/null || { echo "error: $tool is missing; install it (apt-get install $tool)" >&2; exit 1; }
done

mkdir -p "$DEST"
cd "$DEST"
if [[ -d training && -d validation && -d evaluation ]]; then
    echo "Food-11 already in $DEST; organizing only"
else
    echo "downloading Food-11 from $URL"
    curl --fail --location --retry 3 --output Food-11.zip "$URL"
    unzip -q Food-11.zip
    rm -f Food-11.zip
    # Some mirrors wrap the splits in a Food-11/ folder.
    if [[ -d Food-11/training ]]; then mv Food-11/* . && rmdir Food-11; fi
fi

moved=0
for split in training validation evaluation; do
    [[ -d "$split" ]] || { echo "error: $DEST/$split is missing after unzip; check the archive" >&2; exit 1; }
    for i in "${!CLASSES[@]}"; do
        dir="$split/$(printf 'class_%02d' "$i")"
        mkdir -p "$dir"
        # Files are named <class index>_<n>.jpg; move this class's files into its folder.
        while IFS= read -r -d '' file; do
            mv "$file" "$dir/"
            moved=$((moved + 1))
        done < <(find "$split" -maxdepth 1 -type f -name "${i}_*" -print0)
    done
done

echo "moved $moved files; images per split:"
for split in training validation evaluation; do
    echo "  $split: $(find "$split" -type f | wc -l)"
done
echo "classes (class_NN = index in this list): ${CLASSES[*]}"
echo "ready: labkit train --strategy single --model resnet50 --profile a100x1 --data $DEST"
